"""Malformed inputs to paged_decode raise ValueError/TypeError naming the argument; with the host
checks switched off the kernels fail closed on the same values."""

import dataclasses

import pytest
import torch

from kvattn import Violation
from kvattn_testing.util import Batch, backends_under_test


def base():
    return Batch.random(
        batch=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seq_lens=[5, 8],
        dtype=torch.float16,
    )


def replaced(**changes):
    def make():
        b = base()
        return dataclasses.replace(b, **{k: f(b) for k, f in changes.items()})

    return make


META = torch.device("meta")

# name -> (batch factory, decode kwargs, exception, words the message must contain)
MALFORMED = {
    "q_ndim": (replaced(q=lambda b: b.q[0]), {}, ValueError, ["q", "3-D"]),
    "q_dtype_float64": (replaced(q=lambda b: b.q.double()), {}, TypeError, ["q", "float64"]),
    "q_not_tensor": (replaced(q=lambda b: b.q.tolist()), {}, TypeError, ["q", "list"]),
    "q_last_dim_strided": (
        replaced(q=lambda b: torch.cat([b.q, b.q], -1)[..., ::2]),
        {},
        ValueError,
        ["q", "contiguous last dimension"],
    ),
    "q_empty_batch": (replaced(q=lambda b: b.q[:0]), {}, ValueError, ["q", "batch"]),
    "k_ndim": (replaced(k_cache=lambda b: b.k_cache[0]), {}, ValueError, ["k_cache", "4-D"]),
    "k_dtype_vs_q": (
        replaced(k_cache=lambda b: b.k_cache.float(), v_cache=lambda b: b.v_cache.float()),
        {},
        TypeError,
        ["k_cache", "float32"],
    ),
    "v_dtype_vs_k": (replaced(v_cache=lambda b: b.v_cache.bfloat16()), {}, TypeError, ["v_cache"]),
    "v_shape": (replaced(v_cache=lambda b: b.v_cache[:-1]), {}, ValueError, ["v_cache", "shape"]),
    "k_int_dtype": (
        replaced(k_cache=lambda b: b.k_cache.to(torch.int16)),
        {},
        TypeError,
        ["k_cache", "int16"],
    ),
    "page_size_0": (
        replaced(k_cache=lambda b: b.k_cache[:, :0], v_cache=lambda b: b.v_cache[:, :0]),
        {},
        ValueError,
        ["k_cache", "page_size", "0"],
    ),
    "page_size_1028": (
        replaced(
            k_cache=lambda b: b.k_cache.repeat(1, 257, 1, 1),
            v_cache=lambda b: b.v_cache.repeat(1, 257, 1, 1),
        ),
        {},
        ValueError,
        ["k_cache", "page_size", "1028"],
    ),
    "head_dim_mismatch": (
        replaced(k_cache=lambda b: b.k_cache[..., :8], v_cache=lambda b: b.v_cache[..., :8]),
        {},
        ValueError,
        ["k_cache", "head_dim"],
    ),
    "kv_heads_not_dividing": (
        replaced(
            k_cache=lambda b: b.k_cache.repeat(1, 1, 3, 1)[:, :, :3],
            v_cache=lambda b: b.v_cache.repeat(1, 1, 3, 1)[:, :, :3],
        ),
        {},
        ValueError,
        ["k_cache", "num_kv_heads"],
    ),
    "k_last_dim_strided": (
        replaced(k_cache=lambda b: torch.cat([b.k_cache] * 2, -1)[..., ::2]),
        {},
        ValueError,
        ["k_cache", "contiguous last dimension"],
    ),
    "v_last_dim_strided": (
        replaced(v_cache=lambda b: torch.cat([b.v_cache] * 2, -1)[..., ::2]),
        {},
        ValueError,
        ["v_cache", "contiguous last dimension"],
    ),
    "block_table_int64": (
        replaced(block_table=lambda b: b.block_table.long()),
        {},
        TypeError,
        ["block_table", "int32"],
    ),
    "block_table_rows": (
        replaced(block_table=lambda b: b.block_table[:1]),
        {},
        ValueError,
        ["block_table", "shape"],
    ),
    "block_table_ndim": (
        replaced(block_table=lambda b: b.block_table[0]),
        {},
        ValueError,
        ["block_table", "2-D"],
    ),
    "seq_lens_int64": (
        replaced(seq_lens=lambda b: b.seq_lens.long()),
        {},
        TypeError,
        ["seq_lens", "int32"],
    ),
    "seq_lens_shape": (
        replaced(seq_lens=lambda b: b.seq_lens[:1]),
        {},
        ValueError,
        ["seq_lens", "shape"],
    ),
    "page_tags_int32": (
        replaced(page_tags=lambda b: b.page_tags.int()),
        {},
        TypeError,
        ["page_tags", "int64"],
    ),
    "page_tags_shape": (
        replaced(page_tags=lambda b: b.page_tags[1:]),
        {},
        ValueError,
        ["page_tags", "shape"],
    ),
    "page_tags_strided": (
        replaced(page_tags=lambda b: b.page_tags.repeat_interleave(2)[::2]),
        {},
        ValueError,
        ["page_tags", "contiguous"],
    ),
    "expected_int32": (
        replaced(expected=lambda b: b.expected.int()),
        {},
        TypeError,
        ["expected", "int64"],
    ),
    "expected_shape": (
        replaced(expected=lambda b: b.expected[:1]),
        {},
        ValueError,
        ["expected", "shape"],
    ),
    "expected_owner_zero_read": (
        replaced(expected=lambda b: torch.tensor([1, 0])),
        {},
        ValueError,
        ["expected", "expected[1, 0] = 0"],
    ),
    "expected_owner_too_large": (
        replaced(expected=lambda b: torch.tensor([1, 2**47])),
        {},
        ValueError,
        ["expected", str(2**47)],
    ),
    "seq_len_negative": (
        replaced(seq_lens=lambda b: torch.tensor([-1, 8], dtype=torch.int32)),
        {},
        ValueError,
        ["seq_lens", "seq_lens[0] = -1"],
    ),
    "seq_len_beyond_table": (
        replaced(seq_lens=lambda b: torch.tensor([5, 9], dtype=torch.int32)),
        {},
        ValueError,
        ["seq_lens", "seq_lens[1] = 9", "[0, 8]"],
    ),
    "k_on_meta": (
        replaced(k_cache=lambda b: b.k_cache.to(META), v_cache=lambda b: b.v_cache.to(META)),
        {},
        ValueError,
        ["k_cache", "meta"],
    ),
    "block_table_on_meta": (
        replaced(block_table=lambda b: b.block_table.to(META)),
        {},
        ValueError,
        ["block_table", "meta"],
    ),
    "page_tags_on_meta": (
        replaced(page_tags=lambda b: b.page_tags.to(META)),
        {},
        ValueError,
        ["page_tags", "meta"],
    ),
    "scale_zero": (base, dict(scale=0.0), ValueError, ["scale", "0.0"]),
    "scale_negative": (base, dict(scale=-1.0), ValueError, ["scale"]),
    "scale_nan": (base, dict(scale=float("nan")), ValueError, ["scale", "nan"]),
    "scale_bool": (base, dict(scale=True), ValueError, ["scale", "True"]),
    "scale_str": (base, dict(scale="0.1"), ValueError, ["scale"]),
    "on_violation_bad": (base, dict(on_violation="warn"), ValueError, ["on_violation", "warn"]),
    "unchecked_raise": (
        base,
        dict(check=False, on_violation="raise"),
        ValueError,
        ["on_violation", "check=False"],
    ),
    "check_not_bool": (base, dict(check=1), TypeError, ["check", "int"]),
    "backend_unknown": (base, dict(backend="tpu"), ValueError, ["backend", "tpu"]),
    "backend_not_str": (base, dict(backend=None), TypeError, ["backend"]),
    "out_dtype": (base, dict(out=torch.empty(2, 4, 16)), TypeError, ["out", "float32"]),
    "out_shape": (
        base,
        dict(out=torch.empty(2, 4, 8, dtype=torch.float16)),
        ValueError,
        ["out", "shape"],
    ),
    "out_last_dim_strided": (
        base,
        dict(out=torch.empty(2, 4, 32, dtype=torch.float16)[..., ::2]),
        ValueError,
        ["out", "contiguous last dimension"],
    ),
    "out_on_meta": (
        base,
        dict(out=torch.empty(2, 4, 16, dtype=torch.float16, device=META)),
        ValueError,
        ["out", "meta"],
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_raises_naming_the_argument(case):
    make, kwargs, error, words = MALFORMED[case]
    batch = make()
    kwargs = dict(kwargs)
    with pytest.raises(error) as info:
        batch.decode(kwargs.pop("backend", "auto"), **kwargs)
    message = str(info.value)
    assert type(info.value) is error
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_well_formed_base_is_accepted():
    """The twin of every case above: the unmodified batch decodes, so each failure is its change."""
    out, report = base().decode("auto")
    assert torch.isfinite(out).all() and not report.any()


def test_owner_zero_for_an_unread_entry_is_accepted():
    """The twin of expected_owner_zero_read: entries past seq_len are never read, owner 0 is fine."""
    b = Batch.random(
        batch=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        seq_lens=[5, 8],
        dtype=torch.float16,
        extra_pages=1,
    )
    expected = torch.tensor([[1, 1, 0], [2, 2, 0]])
    assert expected.shape == b.block_table.shape
    out, report = dataclasses.replace(b, expected=expected).decode("auto")
    assert torch.isfinite(out).all() and not report.any()


def needs_triton():
    return pytest.mark.skipif(
        "triton" not in backends_under_test(), reason="triton cannot run here"
    )


def wide_head_batch():
    return Batch.random(
        batch=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=520,
        page_size=4,
        seq_lens=[3],
        dtype=torch.float32,
    )


@needs_triton()
def test_forced_backend_that_refuses_raises_with_its_reason():
    with pytest.raises(ValueError) as info:
        wide_head_batch().decode("triton")
    assert "backend" in str(info.value) and "head_dim 520 > 512" in str(info.value)


@needs_triton()
def test_env_var_forces_the_backend(monkeypatch):
    """KVATTN_BACKEND=triton on inputs Triton refuses raises instead of falling back, which shows
    the variable chose the backend; unset, "auto" falls back and runs."""
    batch = wide_head_batch()
    monkeypatch.delenv("KVATTN_BACKEND", raising=False)
    out, report = batch.decode("auto")
    torch.testing.assert_close(out.float(), batch.reference()[0])
    monkeypatch.setenv("KVATTN_BACKEND", "triton")
    with pytest.raises(ValueError) as info:
        batch.decode("auto")
    assert "KVATTN_BACKEND" in str(info.value) and "head_dim 520 > 512" in str(info.value)
    # An explicit backend argument wins over the variable.
    out, _ = batch.decode("reference")
    assert torch.isfinite(out).all()


def test_env_var_with_unknown_name_raises_naming_it(monkeypatch):
    monkeypatch.setenv("KVATTN_BACKEND", "tpu")
    with pytest.raises(ValueError) as info:
        base().decode("auto")
    assert "KVATTN_BACKEND" in str(info.value) and "tpu" in str(info.value)


def test_env_var_auto_is_auto(monkeypatch):
    monkeypatch.setenv("KVATTN_BACKEND", "auto")
    out, report = base().decode("auto")
    assert torch.isfinite(out).all() and not report.any()


# --- validate=False: the kernels fail closed on the values the host checks would refuse ---------


@pytest.fixture(params=backends_under_test())
def backend(request):
    return request.param


def test_unvalidated_seq_len_beyond_table_is_out_of_range(backend):
    b = base()
    b.seq_lens[1] = 1000
    out, lse, report = b.decode(backend, validate=False, return_lse=True)
    assert report.violations.tolist() == [0, 1]
    assert report.reasons.tolist() == [0, int(Violation.OUT_OF_RANGE)]
    assert report.beyond_table.tolist() == [0, 1]
    clipped = dataclasses.replace(b, seq_lens=torch.tensor([5, 8], dtype=torch.int32))
    ref_out, ref_lse, _ = clipped.reference(return_lse=True)
    torch.testing.assert_close(out.float(), ref_out, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_unvalidated_owner_zero_is_owner_mismatch(backend):
    b = dataclasses.replace(base(), expected=torch.tensor([1, 0]))
    out, lse, report = b.decode(backend, validate=False, return_lse=True)
    assert report.violations.tolist() == [0, 2]
    assert report.reasons.tolist() == [0, int(Violation.OWNER_MISMATCH)]
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert torch.isfinite(out[0]).all()


def test_unvalidated_negative_seq_len_reads_nothing(backend):
    b = base()
    b.seq_lens[0] = -5
    out, lse, report = b.decode(backend, validate=False, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert report.pages_checked.tolist() == [0, 2] and report.violations.tolist() == [0, 0]


def test_validate_true_checks_values_explicitly():
    b = base()
    b.seq_lens[1] = 1000
    with pytest.raises(ValueError, match="seq_lens"):
        b.decode("auto", validate=True)
