"""The attention variants, written down once: switches of the same decode and extend kernels.

Every switch changes the scores a query gives its keys, or which keys it reads; none changes the
reader's rule (docs/ownership.md section 3): a refused slot never contributes, whatever the switch.
With ``q_pos`` the position of a query (decode: ``seq_len - 1``; extend: ``seq_len - q_len + j``)
and ``s = scale * q . k_j`` the score of key ``j``:

``window_left`` (int, default -1: off; FlashInfer's convention)
    Sliding window: the query reads keys ``j >= q_pos - window_left`` only (and, causal,
    ``j <= q_pos``). FlashAttention's ``window_size=(left, right)`` is ``window_left = left`` with
    causal attention (``right = 0``) or non-causal attention (``right = -1``); vLLM's and Hugging
    Face's ``sliding_window = W`` (the query and the ``W - 1`` keys before it) is ``window_left =
    W - 1``. Keys older than the window are neither read nor checked: a page wholly before the first
    key any query of the sequence reads is not counted in ``pages_checked`` and never refused; a page
    straddling the window edge is checked like any page read (its ``valid_len`` must cover the slots
    read, so its head may be stale).
``window_right`` (int, default -1: off; :func:`kvattn.paged_extend` only)
    The window's right edge (FlashAttention's two-sided local attention, ``window_size=(left,
    right)``): the query reads keys ``j <= q_pos + window_right`` only. It matters without
    causality (with it, ``j <= q_pos`` already holds: any ``window_right >= 0`` changes nothing,
    and FlashAttention's causal local ``(left, 0)`` is ``window_left = left``); ``window_left`` may
    stay -1 (one-sided on the right). It never changes which pages are checked: the new tokens are
    the last ones, so the sequence's last row sits at ``seq_len - 1`` and reads through the last
    key whatever the right edge. Keys after every row's right edge are not loaded.
``logits_soft_cap`` (float, default 0: off)
    ``s = cap * tanh(s / cap)`` before the softmax (Gemma 2, Grok), as FlashInfer and vLLM define it.
    A cap is 0 or in ``[2**-126, 2**126]`` (the normal float32 range, as for ``scale``).
``sinks`` (``[num_heads]`` float32 tensor, default None)
    One learnable logit per query head that joins the softmax denominator and contributes no value
    (gpt-oss): ``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``. The returned ``lse``
    covers the keys only, so results over key ranges still merge as without sinks, and a row with
    nothing readable still gives output 0 and lse -inf. A sink of -inf is no sink for its head;
    NaN and +inf are invalid.
``alibi_slopes`` (float32 tensor ``[num_heads]`` or ``[batch, num_heads]``, default None)
    ``s += slope * (j - q_pos)`` for causal attention and decode (vLLM's paged attention), and
    ``s -= slope * |j - q_pos|`` without causality (FlashAttention's ALiBi). One slope per query
    head, or, ``[batch, num_heads]`` (FlashAttention's per-sequence slopes), one per sequence and
    head: sequence ``b`` uses row ``b``. A slope is finite with ``|slope| <= 2**32``
    (:data:`ALIBI_SLOPE_MAX`). Every backend measures the distance from the row's anchor
    ``a = min(q_pos, capacity - 1)`` (:func:`alibi_anchor`; ``capacity`` the table's width in
    tokens, so no key a row reads lies past ``a``) and adds the rest, ``slope * (a - q_pos)``, the
    same for each key of the row, to its lse and against its sink once the keys are summed: the
    same softmax. It matters only past the table (an unvalidated ``seq_len``, possibly near
    2**31), where a float32 logit of ``slope * (j - q_pos)`` keeps no digit that tells two keys
    apart and each backend would round it its own way.
``k_scale``, ``v_scale`` (float, or float32 tensor ``[]``, ``[1]``, ``[num_kv_heads]`` or
``[batch, num_kv_heads]``; default 1)
    Only with fp8 pools (``float8_e4m3fn`` or ``float8_e5m2`` ``k_cache``/``v_cache``, while ``q``
    is float16/bfloat16/float32 and sets the output dtype, or fp8: ``q_scale``): a key element is
    ``k_cache[...] * k_scale[kv_head]`` in float32, likewise V (vLLM's and FlashInfer's per-tensor
    or per-head scales). ``[batch, num_kv_heads]`` is FlashAttention 3's per-sequence
    ``k_descale``/``v_descale``: sequence ``b`` reads its keys with ``k_scale[b, kv_head]``. The
    readers only: :func:`kvattn.write_kv` divides by a per-tensor or per-head scale when it
    quantises (a pool's page holds one scale whichever sequence reads it). The tags are unchanged.
    A scale lies in ``[2**-126, 2**126]``. Per-sequence scales over pages that several sequences
    read (a shared prefix) dequantise the same bytes by each reader's own row: the rows must agree
    on such pages for the readers to agree on their keys.
``q_scale`` (float, or float32 tensor ``[]``, ``[1]``, ``[num_kv_heads]`` or ``[batch,
num_kv_heads]``; default 1; only with an fp8 ``q``)
    fp8 queries (FlashAttention 3's ``q_descale``, vLLM's fp8 attention): ``q`` is
    ``float8_e4m3fn`` or ``float8_e5m2`` over fp8 pools (either format each), a query element is
    ``q[...] * q_scale[kv_head]`` (the scale of the KV head its query head reads, as FA3 indexes
    ``q_descale [batch, num_kv_heads]``), and the output is bfloat16 unless the caller's ``out``
    says float16 or float32 (:func:`kvattn.layout.output_dtype`). The kernels upcast the query
    codes to bfloat16 exactly (every e4m3 and e5m2 value is a bfloat16) and fold ``q_scale`` into
    the logit scale, so an fp8 query costs the same dot products as a bfloat16 one. Range and
    forms as ``k_scale``; given in a form other than the KV scales' (per sequence against per head),
    the shared ones are widened to ``[batch, num_kv_heads]`` (one stride serves all three).

``custom_mask`` (1-D bool tensor, default None; :func:`kvattn.paged_extend` only)
    FlashInfer's ``custom_mask``: per sequence ``b`` a row-major ``[q_len_b, seq_lens[b]]`` block,
    the blocks concatenated in batch order (``b``'s starts at the sum of ``q_len * seq_len`` of the
    sequences before it; computed on the device, no synchronisation). Query row ``j`` of ``b``
    reads key ``n`` only where its block holds True at ``[j, n]``. The mask is one more mask: it is
    ANDed with causality (when ``causal``), the window, the length and the reader's rule, so it only
    removes keys, and ``causal=False`` makes it the only position mask (FlashInfer's custom mode,
    which ignores causality). Tree attention, the verify step of speculative decoding: the draft
    tokens are the last ``q_len`` tokens and row ``j`` holds True on the prefix, on ``j`` and on
    ``j``'s ancestors in the draft tree. Pages are checked and reported as without a mask (one
    whose keys the mask removes from every row is still checked and may still be refused). A key
    the mask removes from every query row of its sequence is never loaded, so it may hold anything
    (a key some row reads is read: a NaN in it may reach that row's tile-mates as 0 * NaN, as a
    key past a row's causal position does). Entries past the tensor's end (a mask shorter than its
    blocks, possible only unvalidated: :func:`kvattn.layout.check_mask_length`) read as False.

Order of operations on a score: scale, soft-cap, ALiBi, then the masks (custom mask, window on
either side, causality, length, ownership) set refused and masked scores to -inf.

Values (docs/ownership.md section 8). A float cap or scale outside its range always raises
``ValueError`` naming it. The values of the tensors (sinks, slopes, scale tensors) are checked as
the lengths are (:mod:`kvattn.layout`): on CPU tensors or with ``validate=True``, by
:func:`check_values`, with a ``ValueError`` naming the argument and the head (and the sequence,
for per-sequence values). Unvalidated (a GPU's default path) they are not read on the host and
every backend applies one rule instead (:meth:`Variant.heads_read`): a query head whose sink or
slope is invalid, or whose KV head's ``k_scale``, ``v_scale`` or ``q_scale`` is, reads nothing in
the sequences those values belong to (all of them for shared values) (output 0, lse -inf); the
report is unchanged (the values are not an ownership matter). The kernels state the same rule next
to a pointer here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The largest finite value of each fp8 format: the writer saturates to it (vLLM's convention), since
# e4m3fn has no infinity and an overflowing cast would store NaN.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The kernels scale logits in float32 (the CUDA ones by scale * log2(e)), and divide by the soft-cap
# and multiply by KV scales there: a value outside the normal float32 range would flush to 0 or
# overflow to inf. The range of ``scale`` (kvattn.layout), of ``logits_soft_cap`` and of the KV
# scales.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
# ALiBi adds slope * distance, and a distance is below 2**31 in magnitude (positions are int32):
# slopes up to 2**32 keep that product below 2**63, finite in float32 (also times log2(e), the
# kernels' base 2), whatever the lengths.
ALIBI_SLOPE_MAX = 2.0**32


def alibi_anchor(q_pos, capacity: int):
    """The position ALiBi measures a row's keys from (the ``alibi_slopes`` entry above): ``q_pos``
    (an int64 tensor), or ``capacity - 1`` for a row past the table."""
    return q_pos.clamp(max=capacity - 1)


def scale_ok(x):
    """Whether a KV scale (a float or a tensor, elementwise) is valid: in ``[MIN_SCALE, MAX_SCALE]``
    (False for NaN)."""
    return (x >= MIN_SCALE) & (x <= MAX_SCALE)


def sink_ok(x):
    """Whether a sink logit is valid: finite, or -inf (no sink); NaN and +inf are not."""
    return x < math.inf


def slope_ok(x):
    """Whether an ALiBi slope is valid: ``|slope| <= ALIBI_SLOPE_MAX`` (False for NaN and inf)."""
    return abs(x) <= ALIBI_SLOPE_MAX


@dataclass(frozen=True, eq=False)
class Variant:
    """The validated switches of one call (see the module docstring). ``k_scale``/``v_scale`` are
    ``[num_kv_heads]`` float32 tensors on the query's device when the pools are fp8, else None, or
    both ``[batch, num_kv_heads]`` when either was given per sequence; ``alibi_slopes``
    ``[num_heads]`` or ``[batch, num_heads]``.
    ``mask_start`` ``[B]`` int64: where each sequence's block of ``custom_mask`` starts (set with
    it, by :func:`kvattn.layout.with_custom_mask`). ``widened``: the scale given per tensor or per
    head and widened to ``[batch, num_kv_heads]`` beside a per-sequence one (its value errors then
    name the KV head alone), so ``widened`` holds the names of the scales so widened.
    ``q_scale`` ``[num_kv_heads]`` or ``[batch, num_kv_heads]`` with an fp8 ``q``, else None."""

    window_left: int = -1
    logits_soft_cap: float = 0.0
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None
    mask_start: torch.Tensor | None = None
    window_right: int = -1
    widened: tuple[str, ...] = ()
    q_scale: torch.Tensor | None = None

    def __post_init__(self):
        given = {name: t for name, t in self._scales().items() if t is not None}
        if len({t.dim() for t in given.values()}) > 1:
            # The kernels read every scale with one per-sequence stride.
            raise ValueError(
                f"{', '.join(given)}: expected the same form (all per sequence or "
                "none), got shapes " + ", ".join(str(tuple(t.shape)) for t in given.values())
            )

    def _scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale, "q_scale": self.q_scale}

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0

    @property
    def right_windowed(self) -> bool:
        return self.window_right >= 0

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def q_fp8(self) -> bool:
        return self.q_scale is not None

    @property
    def alibi_stride(self) -> int:
        """Elements between two sequences' slopes: 0 when every sequence shares one set."""
        return _seq_stride(self.alibi_slopes)

    @property
    def scale_stride(self) -> int:
        """Elements between two sequences' KV (and query) scales: 0 when every sequence shares
        them."""
        return _seq_stride(self.k_scale)

    def of_sequences(self, seqs: torch.Tensor | int) -> Variant:
        """The switches of sequences ``seqs`` (``[S]`` int64 indices, or one index) as a call
        over just those: per-sequence slopes and scales keep their rows ``seqs``, the rest is
        shared."""

        def rows(t):
            return t[seqs : seqs + 1] if isinstance(seqs, int) else t.index_select(0, seqs)

        pick = {
            name: rows(getattr(self, name))
            for name in ("alibi_slopes", "k_scale", "v_scale", "q_scale")
            if _seq_stride(getattr(self, name))
        }
        return replace(self, **pick) if pick else self

    def heads_read(self, num_heads: int) -> torch.Tensor | None:
        """``[num_heads]`` bool, or ``[batch, num_heads]`` when a switch is per sequence: False
        for a query head that reads nothing because its sink or slope, or a scale of its KV head
        (``k_scale``, ``v_scale``, ``q_scale``), is invalid (the module docstring's rule for
        unvalidated values); None when no switch
        carries per-head values."""
        ok = None
        if self.sinks is not None:
            ok = sink_ok(self.sinks)
        if self.alibi_slopes is not None:
            slopes = slope_ok(self.alibi_slopes)
            ok = slopes if ok is None else ok & slopes
        if self.fp8:
            kv = scale_ok(self.k_scale) & scale_ok(self.v_scale)
            if self.q_fp8:
                kv = kv & scale_ok(self.q_scale)
            kv = kv.repeat_interleave(num_heads // kv.shape[-1], dim=-1)
            ok = kv if ok is None else ok & kv
        return ok

    def switches(self) -> list[str]:
        """Names of the switches that are on (for the backends' refusal reasons)."""
        on = [
            ("window_left", self.windowed),
            ("window_right", self.right_windowed),
            ("logits_soft_cap", self.logits_soft_cap > 0),
            ("sinks", self.sinks is not None),
            ("alibi_slopes", self.alibi_slopes is not None),
            ("fp8 KV", self.fp8),
            ("fp8 queries", self.q_fp8),
            ("custom_mask", self.custom_mask is not None),
        ]
        return [name for name, active in on if active]


PLAIN = Variant()


def _seq_stride(t: torch.Tensor | None) -> int:
    return t.shape[1] if t is not None and t.dim() == 2 else 0


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _per_head(
    name: str, t, num_heads: int, device, batch: int | None = None
) -> torch.Tensor | None:
    """A ``[num_heads]`` float32 tensor on ``device``, or with ``batch`` also ``[batch,
    num_heads]`` (one row per sequence)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype float32, got {str(t.dtype).replace('torch.', '')}")
    shapes = [(num_heads,)] + ([(batch, num_heads)] if batch is not None else [])
    if tuple(t.shape) not in shapes:
        what = (
            f"shape ({num_heads},) (one value per query head)"
            if batch is None
            else f"shape ({num_heads},) or ({batch}, {num_heads}) (per query head, or per "
            "sequence and query head)"
        )
        _fail(name, what, f"{tuple(t.shape)}")
    if t.device != device:
        _fail(name, f"a tensor on {device} (the device of q)", f"one on {t.device}")
    return t.contiguous()


def _kv_scale(
    name: str, value, num_kv_heads: int, device, device_of: str = "q", batch: int | None = None
) -> torch.Tensor:
    """A per-tensor or per-head dequantisation scale as a ``[num_kv_heads]`` float32 tensor, or,
    with ``batch`` (the readers), a per-sequence one ``[batch, num_kv_heads]`` as given
    (``device_of``: the argument whose device the scale must be on, for the message)."""
    if value is None:
        value = 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name}: expected a float or a float32 tensor, got {type(value).__name__}")
    if not isinstance(value, torch.Tensor):
        if not scale_ok(value):  # exact for ints of any size
            _fail(name, "a positive finite scale in [2**-126, 2**126]", repr(value))
        return torch.full((num_kv_heads,), float(value), dtype=torch.float32, device=device)
    if value.dtype != torch.float32:
        raise TypeError(
            f"{name}: expected dtype float32, got {str(value.dtype).replace('torch.', '')}"
        )
    if value.device != device:
        _fail(name, f"a tensor on {device} (the device of {device_of})", f"one on {value.device}")
    if value.numel() == 1 and value.dim() <= 1:
        return value.reshape(1).expand(num_kv_heads).contiguous()
    if tuple(value.shape) == (num_kv_heads,) or (
        batch is not None and tuple(value.shape) == (batch, num_kv_heads)
    ):
        return value.contiguous()
    shapes = (
        f"(), (1,) or ({num_kv_heads},)"
        if batch is None
        else (f"(), (1,), ({num_kv_heads},) or ({batch}, {num_kv_heads})")
    )
    if batch is None and value.dim() == 2:
        shapes += " (per-sequence scales are for the readers: a page holds one scale)"
    _fail(name, f"shape {shapes}", f"{tuple(value.shape)}")


def check_variant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: int,
    *,
    window_left=-1,
    logits_soft_cap=0.0,
    sinks=None,
    alibi_slopes=None,
    k_scale=None,
    v_scale=None,
    window_right=-1,
    q_scale=None,
) -> Variant:
    """Validate the switches of a decode or extend call of ``batch`` sequences against ``q``
    ``[rows, num_heads, D]`` and the pools (``window_right``: extend only; ``q`` fp8 only with fp8
    pools, checked by :mod:`kvattn.layout`); returns :data:`PLAIN` when none is on."""
    for name, edge in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(edge, bool) or not isinstance(edge, int):
            raise TypeError(f"{name}: expected an int, got {type(edge).__name__}")
        if edge < -1 or edge >= 2**31 - 1:
            _fail(name, "-1 (no window) or a key count in [0, 2**31 - 1)", edge)
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
        raise TypeError(f"logits_soft_cap: expected a float, got {type(logits_soft_cap).__name__}")
    if logits_soft_cap != 0 and not MIN_SCALE <= logits_soft_cap <= MAX_SCALE:  # False for NaN
        _fail(
            "logits_soft_cap",
            "0 (off) or a positive finite cap in [2**-126, 2**126]",
            repr(logits_soft_cap),
        )
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    sinks = _per_head("sinks", sinks, num_heads, q.device)
    alibi_slopes = _per_head("alibi_slopes", alibi_slopes, num_heads, q.device, batch)
    fp8 = k_cache.dtype in FP8_DTYPES
    if not fp8 and (k_scale is not None or v_scale is not None):
        _fail(
            "k_scale" if k_scale is not None else "v_scale",
            "None with float16/bfloat16/float32 pools (scales dequantise fp8 pools)",
            f"a scale with {str(k_cache.dtype).replace('torch.', '')} pools",
        )
    q_fp8 = q.dtype in FP8_DTYPES
    if not q_fp8 and q_scale is not None:
        _fail(
            "q_scale",
            "None with a float16/bfloat16/float32 q (it dequantises an fp8 q)",
            f"a scale with a {str(q.dtype).replace('torch.', '')} q",
        )
    given = {
        name: _kv_scale(name, value, num_kv_heads, q.device, batch=batch)
        for name, value, on in (
            ("k_scale", k_scale, fp8),
            ("v_scale", v_scale, fp8),
            ("q_scale", q_scale, q_fp8),
        )
        if on
    }
    widened = ()
    if len({t.dim() for t in given.values()}) > 1:
        # The kernels read every scale with one stride per sequence.
        widened = tuple(name for name, t in given.items() if t.dim() == 1)
        given = {name: t.expand(batch, num_kv_heads).contiguous() for name, t in given.items()}
    variant = Variant(
        window_left,
        float(logits_soft_cap),
        sinks,
        alibi_slopes,
        given.get("k_scale"),
        given.get("v_scale"),
        window_right=window_right,
        widened=widened,
        q_scale=given.get("q_scale"),
    )
    return PLAIN if not variant.switches() else variant


def check_scale_values(name: str, scale: torch.Tensor) -> None:
    """Every element of a ``[num_kv_heads]`` (or ``[batch, num_kv_heads]``) scale tensor valid
    (:func:`scale_ok`); host-side: synchronises on a device tensor."""
    _check_each(name, scale, scale_ok, "positive finite scales in [2**-126, 2**126]", "KV head")


def check_values(variant: Variant) -> None:
    """The value checks of the switches' tensors (host-side: synchronises on device tensors): sinks
    finite or -inf, slopes within ALIBI_SLOPE_MAX, fp8 scales (KV and query) in range."""
    if variant.sinks is not None:
        _check_each("sinks", variant.sinks, sink_ok, "finite sink logits or -inf (no sink)", "head")
    if variant.alibi_slopes is not None:
        _check_each(
            "alibi_slopes",
            variant.alibi_slopes,
            slope_ok,
            "finite slopes with |slope| <= 2**32",
            "head",
        )
    for name, scale in variant._scales().items():
        if scale is not None:
            check_scale_values(name, scale[0] if name in variant.widened else scale)


def _check_each(name: str, t: torch.Tensor, ok, expected: str, unit: str) -> None:
    values = t.detach().cpu()
    bad = torch.nonzero(~ok(values))
    if bad.numel():
        at = tuple(int(i) for i in bad[0])
        where = f"{unit} {at[-1]}" if len(at) == 1 else f"sequence {at[0]}, {unit} {at[1]}"
        _fail(name, expected, f"{float(values[at])!r} for {where}")
