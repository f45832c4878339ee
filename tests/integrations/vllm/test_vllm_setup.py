"""The vLLM plugin's refusals when an engine is set up: the KV cache dtypes and speculative
proposers it takes, and the ones it refuses naming them. Plain kvattn code
(kvattn.integrations.vllm): no vLLM install needed, unlike the rest of this folder."""


def _vllm_config(
    cache_dtype="auto",
    speculative=None,
    multimodal=False,
    encoder_decoder=False,
    prompt_embeds=False,
    transfer=None,
    context_parallel=1,
):
    from types import SimpleNamespace

    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=context_parallel, prefill_context_parallel_size=1
        ),
        kv_transfer_config=transfer,
        speculative_config=speculative,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        model_config=SimpleNamespace(
            is_multimodal_model=multimodal,
            is_encoder_decoder=encoder_decoder,
            enable_prompt_embeds=prompt_embeds,
        ),
    )


def test_vllm_plugin_takes_the_fp8_caches_it_writes():
    """vLLM's fp8 cache dtypes and the n-gram proposer are accepted when the engine is set up
    (plain kvattn code: no vLLM install needed)."""
    from kvattn.integrations import vllm as integration

    for dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        integration._refuse_unsupported(_vllm_config(dtype))
    # The n-gram proposer's drafts are verified by a causal extend
    # (tests/integrations/vllm/test_vllm_spec.py).
    from types import SimpleNamespace

    integration._refuse_unsupported(_vllm_config(speculative=SimpleNamespace(method="ngram")))
    # Multimodal models: their media is in the prefix digests (test_vllm_multimodal.py).
    integration._refuse_unsupported(_vllm_config(multimodal=True))


def test_vllm_plugin_refuses_other_cache_dtypes_and_speculation_naming_them():
    """The twin: a cache dtype it does not write, speculative decoding by another proposer,
    encoder-decoder models and prompt embeddings are refused with the reason."""
    import pytest

    from kvattn.integrations import vllm as integration

    with pytest.raises(
        integration.IntegrationError,
        match=r"KV cache dtype 'fp8_inc' \(use 'auto' or one of 'fp8', 'fp8_e4m3', "
        r"'fp8_e5m2'\)",
    ):
        integration._refuse_unsupported(_vllm_config("fp8_inc"))
    from types import SimpleNamespace

    for method in ("eagle", "eagle3", "draft_model", "mtp", "suffix"):
        config = _vllm_config(speculative=SimpleNamespace(method=method))
        with pytest.raises(
            integration.IntegrationError,
            match=rf"speculative decoding with method '{method}' "
            r"\(supported: 'ngram'",
        ):
            integration._refuse_unsupported(config)
    with pytest.raises(integration.IntegrationError, match="encoder-decoder models"):
        integration._refuse_unsupported(_vllm_config(encoder_decoder=True))
    with pytest.raises(integration.IntegrationError, match="prompt embeddings"):
        integration._refuse_unsupported(_vllm_config(prompt_embeds=True))


def test_vllm_plugin_takes_kv_connectors_whose_loads_it_verifies():
    """kvattn's checked receivers load KV in any role; any connector sends it (kv_producer). The
    twin: a connector that loads blocks without saying what arrived (vLLM's CPU offloading,
    LMCache, its own NIXL and example connectors) is refused as a consumer, naming it, since
    every block it restores would stay unreadable."""
    from types import SimpleNamespace

    import pytest

    from kvattn.integrations import vllm as integration

    def transfer(connector, role):
        return _vllm_config(transfer=SimpleNamespace(kv_connector=connector, kv_role=role))

    for connector in integration.CHECKED_CONNECTORS:
        for role in ("kv_consumer", "kv_both", "kv_producer"):
            integration._refuse_unsupported(transfer(connector, role))
    integration._refuse_unsupported(transfer("NixlConnector", "kv_producer"))
    for connector in ("OffloadingConnector", "LMCacheConnectorV1", "NixlConnector"):
        for role in ("kv_consumer", "kv_both"):
            with pytest.raises(
                integration.IntegrationError,
                match=rf"KV connector '{connector}' as {role} \(the blocks it loads carry no "
                r"attestation",
            ):
                integration._refuse_unsupported(transfer(connector, role))


def _compiled(config, mode: str, v2: bool = False):
    """``config`` with vLLM's CUDA-graph mode (its enum's name) and runner choice."""
    from types import SimpleNamespace

    config.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode))
    config.use_v2_model_runner = v2
    return config


def test_vllm_plugin_takes_eager_engines_on_both_cache_layouts():
    """No CUDA graphs (vLLM's CPU platform sets cudagraph_mode NONE; on CUDA enforce_eager=True
    does) and vLLM's V1 runner, whose steps the hooks follow: set up on either layout, and the
    CPU layout keeps its fp8 caches and KV connectors."""
    from types import SimpleNamespace

    from kvattn.integrations import vllm as integration

    for layout in integration.LAYOUTS:
        integration._refuse_unsupported(_compiled(_vllm_config(), "NONE"), layout)
    integration._refuse_unsupported(_compiled(_vllm_config("fp8"), "NONE"), "cpu")
    transfer = SimpleNamespace(kv_connector="CheckedNixlConnector", kv_role="kv_consumer")
    integration._refuse_unsupported(_compiled(_vllm_config(transfer=transfer), "NONE"), "cpu")


def test_vllm_plugin_refuses_graphs_runner_v2_and_what_the_gpu_layout_has_not_run():
    """The twin: CUDA graphs (kvattn's tables are filled on the host, fresh each step) and Model
    Runner V2 (vLLM's default on CUDA, which the hooks do not follow) are refused on both
    layouts; an fp8 cache and a KV connector on the GPU layout, naming why."""
    from types import SimpleNamespace

    import pytest

    from kvattn.integrations import vllm as integration

    for layout in integration.LAYOUTS:
        for mode in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
            with pytest.raises(
                integration.IntegrationError,
                match=rf"CUDA graphs \(cudagraph_mode {mode}: run with enforce_eager=True or "
                r"cudagraph_mode NONE\)",
            ):
                integration._refuse_unsupported(_compiled(_vllm_config(), mode), layout)
        with pytest.raises(
            integration.IntegrationError,
            match=r"Model Runner V2 \(set VLLM_USE_V2_MODEL_RUNNER=0\)",
        ):
            integration._refuse_unsupported(_compiled(_vllm_config(), "NONE", v2=True), layout)
    for dtype in integration.FP8_CACHE_DTYPES:
        with pytest.raises(
            integration.IntegrationError,
            match=rf"KV cache dtype '{dtype}' on vLLM's GPU cache layout",
        ):
            integration._refuse_unsupported(_compiled(_vllm_config(dtype), "NONE"), "gpu")
    for role in ("kv_producer", "kv_consumer"):
        transfer = SimpleNamespace(kv_connector="CheckedNixlConnector", kv_role=role)
        with pytest.raises(
            integration.IntegrationError, match=r"KV connectors on vLLM's GPU cache layout"
        ):
            integration._refuse_unsupported(
                _compiled(_vllm_config(transfer=transfer), "NONE"), "gpu"
            )


def test_vllm_layout_setting_takes_cpu_and_gpu(monkeypatch):
    from kvattn.integrations import vllm as integration

    monkeypatch.delenv(integration.LAYOUT_ENV, raising=False)
    assert integration.requested_layout() == "cpu"
    for value, layout in (("gpu", "gpu"), (" GPU ", "gpu"), ("cpu", "cpu"), ("", "cpu")):
        monkeypatch.setenv(integration.LAYOUT_ENV, value)
        assert integration.requested_layout() == layout


def test_vllm_layout_setting_refuses_other_values_naming_it(monkeypatch):
    import pytest

    from kvattn.integrations import vllm as integration

    for value in ("hnd", "NHD", "cuda", "1"):
        monkeypatch.setenv(integration.LAYOUT_ENV, value)
        with pytest.raises(
            ValueError,
            match=rf"KVATTN_VLLM_LAYOUT: expected one of 'cpu', 'gpu', got '{value}'",
        ):
            integration.requested_layout()


def test_vllm_decode_resolves_once_except_where_the_compiled_cpu_decode_checks_each_call(
    monkeypatch,
):
    """A decode step is resolved once for its layers (docs/ownership.md section 9) unless the
    compiled CPU decode runs it, which checks each call's pages itself at the same cost; another
    backend named, or another device, keeps the verdict. Either way every layer is checked."""
    from types import SimpleNamespace

    import torch

    from kvattn import backends
    from kvattn.integrations import vllm as integration

    monkeypatch.delenv(integration.BACKEND_ENV, raising=False)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True), kv_transfer_config=None
    )
    state = integration.WorkerOwnership(config, 16, check=True)
    cpu, cuda = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device="cuda")
    built = backends.load("cpu")[0]._cpu is not None
    assert state._compiled_cpu_decode(cpu) is built
    assert not state._compiled_cpu_decode(cuda)
    state.backend = "torch"
    assert not state._compiled_cpu_decode(cpu)


def test_mla_models_run_where_every_read_reaches_the_backend():
    """An MLA model's engine (layout ``mla``: kvattn's MLA backend) is set up plain; the twin: with
    context parallelism (prefill tokens would go to vLLM's MHA path, which gathers the latent
    cache past the backend), a KV connector or speculative decoding, it is refused, naming each."""
    from types import SimpleNamespace

    import pytest

    from kvattn.integrations import vllm as integration

    integration._refuse_unsupported(_vllm_config(), layout="mla")
    config = _vllm_config(
        speculative=SimpleNamespace(method="ngram"),
        transfer=SimpleNamespace(kv_role="kv_both", kv_connector="CheckedNixlConnector"),
        context_parallel=2,
    )
    with pytest.raises(integration.IntegrationError) as refused:
        integration._refuse_unsupported(config, layout="mla")
    for reason in (
        "MLA with decode or prefill context parallelism",
        "KV connectors with MLA",
        "speculative decoding with MLA",
    ):
        assert reason in str(refused.value)
