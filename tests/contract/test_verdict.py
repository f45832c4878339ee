"""Resolve once per forward (docs/ownership.md section 9): a decode step's verdict, read by every
layer instead of the block table and the tags, gives each layer what its own per-call check gives.

A step is simulated as an engine runs it: every layer's pools and tags hold the sequences' old
tokens, the verdict is resolved before the first layer, and each layer writes its new tokens with
the real writer, then attends. Every slot no tag certifies holds NaN, and each clean case has a
faulted twin.
"""

from __future__ import annotations

import pytest
import torch

import kvattn
from kvattn import reference, resolve_pages
from kvattn.tags import Violation
from kvattn_testing.util import DEVICE, assert_reports_equal, backends_under_test, launcher

LAYERS = 3
# Every backend that reads a verdict: the compiled CPU decode and the CUDA kernels' harness where
# they are built.
BACKENDS = ["reference", "torch", "triton"] + [
    name for name in ("cpu", "cuda_sim") if name in backends_under_test()
]
# Per sequence: (tokens including the new one, fault). 9 and 8 put the new token at the first slot
# of a page for page size 4 and 8 (and mid-page elsewhere).
SEQUENCES = [
    (9, None),
    (11, "owner_mismatch"),
    (14, "out_of_range"),
    (8, "free"),
    (13, "reserved"),
    (10, "unwritten"),
    (17, "fresh_reserved_foreign"),
]


class Step:
    """One decode step over ``LAYERS`` layers: pools ``[L, N, P, H, D]``, tags ``[L, N]``."""

    def __init__(self, page_size: int, seed: int = 0, dtype=torch.float16, sequences=SEQUENCES):
        g = torch.Generator().manual_seed(seed)
        self.page = P = page_size
        self.lens = [n for n, _ in sequences]
        per_seq = [-(-n // P) for n in self.lens]
        self.width = max(per_seq) + 1
        N = self.num_pages = 2 * sum(per_seq) + 4
        H, D, self.heads = 2, 16, 4
        self.k = torch.full((LAYERS, N, P, H, D), float("nan"), dtype=dtype)
        self.v = torch.full((LAYERS, N, P, H, D), float("nan"), dtype=dtype)
        self.tags = torch.zeros(LAYERS, N, dtype=torch.int64)
        self.owners = [kvattn.tags.new_owner_id() for _ in sequences]
        table = torch.zeros(len(sequences), self.width, dtype=torch.int32)
        perm = torch.randperm(N, generator=g).tolist()
        for b, ((n, _), pages) in enumerate(zip(sequences, per_seq)):
            ids = [perm.pop() for _ in range(pages)]
            table[b, :pages] = torch.tensor(ids, dtype=torch.int32)
            for i, p in enumerate(ids):
                old = min(P, max(0, n - 1 - i * P))  # every layer holds the old tokens
                self.k[:, p, :old] = torch.randn(LAYERS, old, H, D, generator=g).to(dtype)
                self.v[:, p, :old] = torch.randn(LAYERS, old, H, D, generator=g).to(dtype)
                tag = kvattn.written_tag(self.owners[b], old) if old else None
                self.tags[:, p] = tag if tag is not None else kvattn.reserved_tag(self.owners[b])
        self.table = table
        self.q = torch.randn(LAYERS, len(sequences), self.heads, D, generator=g).to(dtype)
        self.new_k = torch.randn(LAYERS, len(sequences), H, D, generator=g).to(dtype)
        self.new_v = torch.randn(LAYERS, len(sequences), H, D, generator=g).to(dtype)
        for b, (_, fault) in enumerate(sequences):
            self.fault(b, fault)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32)
        self.expected = torch.tensor(self.owners, dtype=torch.int64)
        self.to(DEVICE)

    def to(self, device) -> None:
        for name in ("k", "v", "tags", "table", "q", "new_k", "new_v", "seq_lens", "expected"):
            setattr(self, name, getattr(self, name).to(device))

    def fault(self, b: int, fault: str | None) -> None:
        """A fault of the host's bookkeeping in every layer (what a verdict must refuse as the
        per-call check does)."""
        P, owner = self.page, self.owners[b]
        first, new_page = int(self.table[b, 0]), int(self.table[b, (self.lens[b] - 1) // P])
        if fault == "owner_mismatch":
            self.tags[:, first] = kvattn.written_tag(kvattn.tags.new_owner_id(), P)
        elif fault == "out_of_range":
            self.table[b, 0] = self.num_pages + 3
        elif fault == "free":
            self.tags[:, first] = kvattn.FREE_TAG
        elif fault == "reserved":
            self.tags[:, first] = kvattn.reserved_tag(owner)
        elif fault == "unwritten":
            self.tags[:, first] = kvattn.written_tag(owner, min(P, self.lens[b] - 1) - 1)
        elif fault == "fresh_reserved_foreign":
            # The new token's page was handed to someone else: this sequence's write is dropped.
            self.tags[:, new_page] = kvattn.reserved_tag(kvattn.tags.new_owner_id())

    def slots(self) -> torch.Tensor:
        return torch.tensor(
            [
                int(self.table[b, (n - 1) // self.page]) * self.page + (n - 1) % self.page
                for b, n in enumerate(self.lens)
            ],
            dtype=torch.int64,
            device=DEVICE,
        )

    def write(self, layer: int, rows=None) -> None:
        """Layer ``layer``'s cache write of the new tokens (``rows``: only those sequences)."""
        slots = self.slots()
        if rows is not None:
            slots = torch.where(
                torch.isin(
                    torch.arange(len(self.lens), device=DEVICE), torch.tensor(rows, device=DEVICE)
                ),
                slots,
                -1,
            )
        kvattn.write_kv(
            self.new_k[layer],
            self.new_v[layer],
            self.k[layer],
            self.v[layer],
            slots,
            self.tags[layer],
            self.expected,
        )

    def resolve(self, window_left: int = -1, backend: str = "auto"):
        return resolve_pages(
            self.table,
            self.seq_lens,
            self.tags,
            self.expected,
            page_size=self.page,
            window_left=window_left,
            backend=backend,
        )

    def decode(self, layer: int, backend: str, **kwargs):
        return kvattn.paged_decode(
            self.q[layer],
            self.k[layer],
            self.v[layer],
            self.table,
            self.seq_lens,
            self.tags[layer],
            self.expected,
            backend=backend,
            return_lse=True,
            **kwargs,
        )


def assert_same(got, want, backend: str) -> None:
    """Bit for bit on the tensor-op backends; on Triton the new token's page is summed in a tile of
    its own, so the sums differ by float32 rounding (far below what one slot moves, > 0.01)."""
    for x, y in zip(got[:2], want[:2]):
        assert torch.isfinite(x[torch.isfinite(y)]).all()
        if backend == "triton":
            torch.testing.assert_close(x, y, atol=2**-10, rtol=2**-10)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("window_left", [-1, 6])
def test_each_layer_through_the_verdict_equals_its_own_check(backend, page_size, window_left):
    s = Step(page_size)
    verdict = s.resolve(window_left)
    for layer in range(LAYERS):
        s.write(layer)
        got = s.decode(layer, backend, verdict=verdict, window_left=window_left)
        want = s.decode(layer, backend, window_left=window_left)
        assert got[2] is verdict.report
        assert_same(got, want, backend)
        assert_reports_equal(got[2], want[2])
        assert torch.isfinite(got[0]).all()
    refused = got[2].refusals()
    # Every fault and no clean sequence (a window leaves some faulted first pages unread).
    assert 0 not in refused and 6 in refused
    if window_left < 0:
        assert sorted(refused) == [1, 2, 3, 4, 5, 6]
    assert refused[6] == [((s.lens[6] - 1) // page_size, Violation.RESERVED)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_clean_step_through_the_verdict_refuses_nothing(backend):
    s = Step(4, seed=1, sequences=[(n, None) for n, _ in SEQUENCES])
    verdict = s.resolve()
    for layer in range(LAYERS):
        s.write(layer)
        got = s.decode(layer, backend, verdict=verdict)
        assert_same(got, s.decode(layer, backend), backend)
    assert int(verdict.report.violations.sum()) == 0
    assert verdict.report.pages_checked.tolist() == [-(-n // 4) for n, _ in SEQUENCES]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_that_did_not_land_in_one_layer_is_not_read_there(backend):
    s = Step(4, seed=2, sequences=[(9, None), (10, None)])
    verdict = s.resolve()
    for layer in range(LAYERS):
        s.write(layer, rows=[0] if layer == 1 else None)  # sequence 1's write is lost in layer 1
        got = s.decode(layer, backend, verdict=verdict)
        want = s.decode(layer, backend)
        assert_same(got, want, backend)
        assert torch.isfinite(got[0]).all()  # its NaN slot stayed unread
    # Counted once for the step, by the layer that refused it.
    assert verdict.report.refusals() == {1: [(2, Violation.UNWRITTEN)]}
    assert verdict.report.violations.tolist() == [0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_one_layer_lost_is_read_by_none(backend):
    """The verdict is the minimum over the layers: a slot one layer's tag refuses is refused in
    every layer (the per-call check would read it where the tag holds)."""
    s = Step(4, seed=3, sequences=[(9, None), (10, None)])
    page = int(s.table[1, 0])
    s.tags[1, page] = kvattn.written_tag(s.owners[1], 2)
    verdict = s.resolve()
    s.write(0)
    got = s.decode(0, backend, verdict=verdict)
    want = s.decode(0, backend)
    assert verdict.report.refusals() == {1: [(0, Violation.UNWRITTEN)]}
    assert want[2].refusals() == {}
    assert (got[0][1] - want[0][1]).abs().max() > 0.01
    assert_same((got[0][:1], got[1][:1]), (want[0][:1], want[1][:1]), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_verdict_made_stale_by_a_release_is_not_read(backend):
    s = Step(4, seed=4, sequences=[(9, None), (10, None)])
    verdict = s.resolve()
    s.write(0)
    page = int(s.table[0, 0])
    kvattn.release_pages(s.tags, [page])
    kvattn.reserve_pages(s.tags, [page], kvattn.tags.new_owner_id())
    got = s.decode(0, backend, verdict=verdict)
    want = s.decode(0, backend)
    assert got[2] is not verdict.report
    assert_same(got, want, backend)
    assert_reports_equal(got[2], want[2])
    assert got[2].refusals() == {0: [(0, Violation.RESERVED)]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tag_set_by_hand_is_not_seen_by_a_verdict(backend):
    """The twin of the stale verdict: without a writer, the verdict is read (section 9 says so)."""
    s = Step(4, seed=4, sequences=[(9, None), (10, None)])
    verdict = s.resolve()
    s.write(0)
    s.tags[0, int(s.table[0, 0])] = kvattn.FREE_TAG
    got = s.decode(0, backend, verdict=verdict)
    want = s.decode(0, backend)
    assert got[2] is verdict.report and got[2].refusals() == {}
    assert want[2].refusals() == {0: [(0, Violation.FREE)]}
    assert (got[0][0] - want[0][0]).abs().max() > 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_forged_entries_outside_the_pool_read_nothing(backend):
    s = Step(4, seed=5, sequences=[(9, None), (10, None)])
    verdict = s.resolve()
    s.write(0)
    entries = verdict.entries.clone()
    verdict.entries[0, 0] = ((s.num_pages + 5) << 32) | 4
    verdict.entries[0, 1] = (-7 << 32) | 4
    got = s.decode(0, backend, verdict=verdict)
    verdict.entries.copy_(entries)
    verdict.entries[0, :2] = -1 << 32  # those pages read nothing
    want = s.decode(0, backend, verdict=verdict)
    assert torch.isfinite(got[0]).all()
    assert_same(got, want, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forged_new_token_entry_reads_nothing_of_that_page(backend):
    """The CUDA kernels load the new token's page's entry from ``fresh``: one outside the pool
    reads nothing of that page there, and a backend that reads the column ignores it."""
    s = Step(4, seed=5, sequences=[(9, None), (10, None)])
    verdict = s.resolve()
    s.write(0)
    clean = s.decode(0, backend, verdict=verdict)
    verdict.fresh[1] = ((s.num_pages + 5) << 32) | 4
    got = s.decode(0, backend, verdict=verdict)
    assert torch.isfinite(got[0]).all()
    assert torch.equal(got[0][0], clean[0][0])
    if backend != "cuda_sim":
        assert_same(got, clean, backend)
        return
    fresh = (s.lens[1] - 1) // s.page
    verdict.fresh[1] = int(verdict.entries[1, fresh])
    verdict.entries[1, fresh] = -1 << 32
    assert_same(got, s.decode(0, backend, verdict=verdict), backend)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("triton", "cuda_sim")])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_kv_reads_the_verdict_alike(backend, num_splits):
    """The kernels that split a sequence's keys: through a verdict as by their own check, split or
    not (the new token's page lies in the last split; its report is added by that split alone)."""
    s = Step(4, seed=6)
    verdict = s.resolve()
    module = launcher(backend)
    for layer in range(2):
        s.write(layer)
        outs = []
        for given in (verdict, None):
            args = kvattn.layout.validate_decode(
                s.q[layer],
                s.k[layer],
                s.v[layer],
                s.table,
                s.seq_lens,
                s.tags[layer],
                s.expected,
            )
            args.verdict = given
            out = torch.empty_like(s.q[layer])
            lse = torch.empty(s.q.shape[1:3], dtype=torch.float32, device=DEVICE)
            report = module.decode(args, check=True, out=out, lse=lse, num_splits=num_splits)
            outs.append((out, lse, report))
        assert_same(outs[0], outs[1], backend)
        assert_reports_equal(outs[0][2], outs[1][2])


def test_a_verdict_that_is_not_this_calls_raises():
    s = Step(4, seed=7, sequences=[(9, None), (10, None)])
    verdict = s.resolve()
    with pytest.raises(TypeError, match="verdict"):
        s.decode(0, "reference", verdict=verdict.entries)
    with pytest.raises(ValueError, match="check=False"):
        s.decode(0, "reference", verdict=verdict, check=False)
    with pytest.raises(ValueError, match="window_left"):
        s.decode(0, "reference", verdict=verdict, window_left=3)
    with pytest.raises(ValueError, match="page_tags"):
        kvattn.paged_decode(
            s.q[0],
            s.k[0],
            s.v[0],
            s.table,
            s.seq_lens,
            s.tags[0].clone(),
            s.expected,
            verdict=verdict,
        )
    with pytest.raises(ValueError, match="block_table"):
        kvattn.paged_decode(
            s.q[0],
            s.k[0],
            s.v[0],
            s.table.clone(),
            s.seq_lens,
            s.tags[0],
            s.expected,
            verdict=verdict,
        )
    with pytest.raises(ValueError, match="expected"):
        kvattn.paged_decode(
            s.q[0],
            s.k[0],
            s.v[0],
            s.table,
            s.seq_lens,
            s.tags[0],
            s.expected.clone(),
            verdict=verdict,
        )


def test_a_backend_that_reads_no_verdict_says_so():
    s = Step(4, seed=7, sequences=[(9, None)])
    args = kvattn.layout.validate_decode(
        s.q[0], s.k[0], s.v[0], s.table, s.seq_lens, s.tags[0], s.expected
    )
    plain = kvattn.backends.explain(args, "decode")
    args.verdict = s.resolve()
    given = kvattn.backends.explain(args, "decode")
    for name, why in plain.items():
        if why is None and name in BACKENDS:
            assert given[name] is None
        elif why is None:
            assert "verdict" in given[name]
    assert given["triton"] is None and given["reference"] is None


@pytest.mark.skipif("cuda_sim" not in BACKENDS, reason="the CUDA kernels' harness is not built")
def test_the_cuda_decode_reads_a_verdict_by_16_byte_copies_only():
    """Rows of 12 fp16 elements are copied element by element, which no verdict instantiation
    does: the CUDA decode refuses the verdict naming why, and ``auto`` reads it on another backend;
    the twin with rows of 16 elements is accepted (as every test above runs it)."""
    s = Step(4, seed=7, sequences=[(9, None)])
    verdict = s.resolve()
    for width, refused in ((12, True), (16, False)):
        k, v = s.k[0][..., :width], s.v[0][..., :width]
        args = kvattn.layout.validate_decode(
            s.q[0][..., :width], k, v, s.table, s.seq_lens, s.tags[0], s.expected
        )
        args.verdict = verdict
        why = kvattn.backends.explain(args, "decode")["cuda_sim"]
        assert (why is not None and "16-byte" in why) if refused else why is None, why


def test_resolve_rejects_malformed_arguments():
    s = Step(4, seed=7, sequences=[(9, None)])
    with pytest.raises(ValueError, match="page_size"):
        resolve_pages(s.table, s.seq_lens, s.tags, s.expected, page_size=0)
    with pytest.raises(ValueError, match="window_left"):
        resolve_pages(s.table, s.seq_lens, s.tags, s.expected, page_size=4, window_left=-2)
    with pytest.raises(ValueError, match="page_tags"):
        resolve_pages(s.table, s.seq_lens, s.tags[None], s.expected, page_size=4)
    with pytest.raises(ValueError, match="backend"):
        resolve_pages(s.table, s.seq_lens, s.tags, s.expected, page_size=4, backend="cuda")
    with pytest.raises(TypeError, match="block_table"):
        resolve_pages(s.table.long(), s.seq_lens, s.tags, s.expected, page_size=4)


def _random_step(seed: int):
    g = torch.Generator().manual_seed(seed)
    layers = [1, 3, 20][seed % 3]
    page = [1, 4, 16][seed % 3]
    width = [3, 9, 140][(seed // 3) % 3]
    batch = 1 + seed % 4
    num_pages = 40
    owners = torch.randint(1, 6, (batch, width), generator=g)
    table = torch.randint(-2, num_pages + 2, (batch, width), generator=g).to(torch.int32)
    state = torch.randint(0, 4, (layers, num_pages), generator=g)
    tag_owner = torch.randint(0, 7, (layers, num_pages), generator=g)
    valid = torch.randint(0, page + 1, (layers, num_pages), generator=g)
    tags = (tag_owner << kvattn.tags.OWNER_SHIFT) | (valid << kvattn.tags.VALID_LEN_SHIFT) | state
    lens = torch.randint(-2, width * page + 3, (batch,), generator=g).to(torch.int32)
    expected = owners if seed % 2 else owners[:, 0].contiguous()
    return table, lens, tags, expected, page


@pytest.mark.parametrize("seed", range(18))
@pytest.mark.parametrize("window_left", [-1, 5])
def test_the_triton_resolve_is_the_oracles(seed, window_left):
    table, lens, tags, expected, page = (
        x.to(DEVICE) if torch.is_tensor(x) else x for x in _random_step(seed)
    )
    got = resolve_pages(
        table, lens, tags, expected, page_size=page, window_left=window_left, backend="triton"
    )
    want = resolve_pages(
        table, lens, tags, expected, page_size=page, window_left=window_left, backend="reference"
    )
    assert torch.equal(got.entries, want.entries)
    assert torch.equal(got.fresh, want.fresh)
    assert_reports_equal(got.report, want.report)


def test_the_oracle_resolve_is_the_per_call_rule_before_the_new_token():
    """With one layer, every page but the new token's gets the per-call rule's readable slots and
    reason (:func:`kvattn.reference.page_verdicts`); the new token's page, its slots before the
    new one (the call judges that one)."""
    for seed in range(9):
        table, lens, tags, expected, page = _random_step(seed)
        tags = tags[:1]
        expected = expected if expected.dim() == 2 else expected[:, None].expand(table.shape)
        verdict = resolve_pages(table, lens, tags, expected, page_size=page)
        readable, _ = reference.unpack_verdict(verdict.entries)
        allowed, report = reference.page_verdicts(table, lens, tags[0], expected, page)
        fresh, slot = reference.fresh_pages(lens, table.shape[1], page)
        others = torch.arange(table.shape[1])[None, :] != fresh[:, None]  # [B, M]
        got = torch.arange(page) < readable[..., None]
        assert torch.equal(got[others], allowed[others])
        assert torch.equal(verdict.report.page_reasons[others], report.page_reasons[others])
        outside = torch.tensor(-1 << 32)
        assert torch.equal(verdict.fresh[fresh < 0], outside.expand(int((fresh < 0).sum())))
        for b in torch.nonzero(fresh >= 0).flatten().tolist():
            f, s = int(fresh[b]), int(slot[b])
            assert int(verdict.fresh[b]) == int(verdict.entries[b, f])
            assert torch.equal(got[b, f, :s], allowed[b, f, :s])
            assert not got[b, f, s:].any()
