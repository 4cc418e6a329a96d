"""The delta codec: exact round trips for every dtype and density, the choice never larger than
dense, and malformed payloads refused without touching the target."""

import struct
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync import delta
from weightsync.bench.updates import AdamWUpdates, changed_elements, changed_fraction, clone_state
from weightsync.delta import format as delta_format
from weightsync.delta.decoder import apply
from weightsync.delta.encoder import encode
from weightsync.delta.format import HEADER_BYTES, Kind
from weightsync.delta.header import digest
from weightsync.plan import TensorSpec, as_bytes

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex32, torch.complex64, torch.complex128,
]  # fmt: skip
DTYPES += [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
]
DELTA_KINDS = [Kind.INDEX, Kind.BITMASK, Kind.GAPS]
HEADER = struct.Struct("<2sBBBBBBQQQQ")
FIELDS = ("magic", "format", "kind", "esize", "width", "low", "reserved", "numel", "count", "ncodes", "nexc")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for exact comparison (copied as integers, never as floats)."""
    if not t.numel():
        return torch.zeros(0, dtype=torch.uint8)
    ints = delta_format.int_view(t).reshape(-1)
    return torch.empty(ints.shape, dtype=ints.dtype).copy_(ints).view(torch.uint8)


def special_bytes(dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns worth having: -0.0, +-inf, NaN with payloads, subnormals, extremes."""
    e = dtype.itemsize
    pats = [b"\x00" * e, b"\xff" * e, b"\x00" * (e - 1) + b"\x80", b"\x01" + b"\x00" * (e - 1)]
    if dtype.is_floating_point or dtype.is_complex:
        base = (
            torch.float64
            if dtype == torch.complex128
            else torch.float32
            if dtype == torch.complex64
            else dtype
        )
        base = torch.float16 if dtype == torch.complex32 else base
        vals = [-0.0, 0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1.0]
        try:
            t = torch.tensor(vals, dtype=torch.float64).to(base)
            raw = as_bytes(t).reshape(len(vals), -1)
            for row in raw:
                r = bytes(row.tolist())
                pats.append(r * (e // len(r)))
        except (RuntimeError, TypeError):
            pass
        pats.append(b"\x5a" * (e - 1) + b"\x7f")  # a NaN (or big number) with a payload
    pool = torch.tensor(list(b"".join(p[:e].ljust(e, b"\0") for p in pats)), dtype=torch.uint8)
    return pool.reshape(-1, e)


def make_pair(dtype, shape, density, mode, seed):
    """base and new tensors of ``shape``: random or special bit patterns, ``density`` of the
    elements changed by ``mode`` (random bits, or a small change in the low bits)."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    e = dtype.itemsize
    raw = torch.randint(0, 256, (n, e), dtype=torch.uint8, generator=gen)
    pool = special_bytes(dtype)
    use_special = torch.rand(n, generator=gen) < 0.3
    if n:
        raw[use_special] = pool[torch.randint(0, pool.shape[0], (int(use_special.sum()),), generator=gen)]
    if dtype == torch.bool:
        raw &= 1
    new = raw.clone()
    change = torch.rand(n, generator=gen) < density
    k = int(change.sum())
    if k:
        if mode == "random":
            new[change] = torch.randint(0, 256, (k, e), dtype=torch.uint8, generator=gen)
        elif mode == "low":  # like a small optimizer step: the lowest byte moves
            new[change, 0] ^= torch.randint(1, 4, (k,), dtype=torch.uint8, generator=gen)
        else:  # special patterns
            new[change] = pool[torch.randint(0, pool.shape[0], (k,), generator=gen)]
        if dtype == torch.bool:
            new &= 1
    as_dtype = lambda r: r.reshape(-1).view(dtype).reshape(shape)  # noqa: E731
    return as_dtype(raw), as_dtype(new)


SENTINEL = 0xA5


def placed(t: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A copy of ``t`` (its exact bits) laid out as ``layout``: ``contiguous``, ``transposed``
    (dims 0 and 1 swapped in memory) or ``sliced`` (every other element of a larger tensor).
    Also returns the memory around it (filled with a sentinel) to check that no write
    landed outside, or None."""
    if layout == "transposed" and t.dim() >= 2:
        shape = list(t.shape)
        shape[0], shape[1] = shape[1], shape[0]
        view = torch.empty(shape, dtype=t.dtype).transpose(0, 1)
        outside = None
    elif layout == "sliced" and t.dim() >= 1:
        big = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        as_bytes(big).fill_(SENTINEL)
        view, outside = big[..., ::2], big[..., 1::2]
    else:
        view, outside = torch.empty_like(t), None
    delta_format.int_view(view).copy_(delta_format.int_view(t))
    return view, outside


shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 12), min_size=1, max_size=3).map(tuple),
    st.integers(0, 4000).map(lambda n: (n,)),
)
pairs = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPES),
    "shape": shapes,
    "density": st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1), st.floats(0, 0.05)),
    "mode": st.sampled_from(["random", "low", "special"]),
    "seed": st.integers(0, 2**31),
})  # fmt: skip


def roundtrip(base, new, enc, layout="contiguous"):
    """Apply ``enc`` to a copy of ``base`` laid out as ``layout``: exactly ``new`` results,
    and nothing around the target is written."""
    target, outside = placed(base, layout)
    payload = enc.payload if enc.kind != Kind.DENSE else as_bytes(new)
    apply(target, enc.kind, payload)
    assert torch.equal(bits(target), bits(new)), (enc.kind, enc.sizes)
    if outside is not None:
        assert bool((bits(outside) == SENTINEL).all()), "wrote outside the target"


@settings(deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=pairs,
    layout=st.sampled_from(["contiguous", "transposed", "sliced"]),
    chunk=st.sampled_from([8, 64, delta.encoder.CHUNK]),
    keep=st.sampled_from([0, delta.encoder.KEEP_FLOOR]),
)
def test_roundtrip_any_dtype_density_layout(p, layout, chunk, keep):
    base, new = make_pair(**p)
    # Small chunks: many per tensor. keep=0: changes beyond half the tensor's bytes are
    # found again when the payload is written.
    with (
        mock.patch.object(delta.encoder, "CHUNK", chunk),
        mock.patch.object(delta.encoder, "KEEP_FLOOR", keep),
    ):
        enc = encode(placed(base, layout)[0], placed(new, layout)[0])
    dense = new.numel() * new.element_size()
    assert enc.nbytes <= dense and enc.dense_nbytes == dense
    assert enc.nbytes == min(enc.sizes.values())
    assert enc.changed == changed_elements(base, new)
    if enc.kind == Kind.DENSE:
        assert enc.payload is None
    else:
        assert (
            enc.payload.dtype == torch.uint8 and enc.payload.dim() == 1 and enc.payload.numel() == enc.nbytes
        )
    if enc.changed == 0 and dense > HEADER_BYTES:
        assert enc.kind == Kind.EMPTY and enc.nbytes == HEADER_BYTES
    roundtrip(base, new, enc, layout)


@settings(deadline=None, max_examples=120)
@given(
    p=pairs,
    kind=st.sampled_from(DELTA_KINDS),
    low_bytes=st.booleans(),
    chunk=st.sampled_from([8, 64, delta.encoder.CHUNK]),
)
def test_every_kind_roundtrips_when_forced(p, kind, low_bytes, chunk):
    base, new = make_pair(**p)
    with mock.patch.object(delta.encoder, "CHUNK", chunk), mock.patch.object(delta.encoder, "KEEP_FLOOR", 0):
        enc = encode(base, new, kinds=[kind], low_bytes=low_bytes)
    assert enc.kind == kind
    assert enc.nbytes == enc.payload.numel()
    roundtrip(base, new, enc, "sliced")


@pytest.mark.parametrize("width", delta.format.GAP_WIDTHS)
def test_gap_escapes_at_every_width(width, monkeypatch):
    # Gaps of every size class: 1, 15, 16, 255, 256, 65535, 65536 and beyond.
    n = 300_000
    base = torch.zeros(n, dtype=torch.int16)
    new = base.clone()
    new[torch.tensor([0, 1, 16, 31, 32, 287, 543, 66078, 131614, 131615, 262000, n - 1])] = 7
    monkeypatch.setattr(delta.encoder, "GAP_WIDTHS", (width,))
    enc = encode(base, new, kinds=[Kind.GAPS])
    assert enc.kind == Kind.GAPS and enc.payload[5] == width
    roundtrip(base, new, enc)


def test_low_bytes_form_is_used_for_small_float_steps():
    torch.manual_seed(0)
    base = (torch.randn(100_000) * 0.02).to(torch.bfloat16)
    new = base.clone()
    pick = torch.rand(base.shape) < 0.05
    new.view(torch.int16)[pick] += 1  # one unit in the last place
    enc = encode(base, new)
    assert "gaps8+low" in enc.sizes and enc.sizes["gaps8+low"] < enc.sizes["gaps8"]
    assert enc.payload[6] == 1  # header byte 6: low bytes L = 1
    roundtrip(base, new, enc)
    full = encode(base, new, low_bytes=False)
    assert full.nbytes > enc.nbytes and full.payload[6] == 0
    roundtrip(base, new, full)


def test_choice_at_typical_densities():
    torch.manual_seed(1)
    n = 1 << 20
    base = (torch.randn(n) * 0.02).to(torch.bfloat16)
    for density, expected in ((0.0, Kind.EMPTY), (0.02, Kind.GAPS), (0.5, Kind.BITMASK), (1.0, Kind.DENSE)):
        new = base.clone()
        pick = torch.rand(n) < density
        new.view(torch.int16)[pick] ^= 0x0101  # the upper byte changes too: whole values travel
        enc = encode(base, new)
        assert enc.kind == expected, (density, enc.kind, enc.sizes)
        roundtrip(base, new, enc)


def test_zero_size_and_scalar():
    for shape in [(0,), (3, 0), ()]:
        base = torch.zeros(shape, dtype=torch.float32)
        new = torch.full(shape, -0.0)
        enc = encode(base, new)
        roundtrip(base, new, enc)
    # -0.0 vs 0.0 is a change; NaN vs the same NaN is not.
    assert encode(torch.tensor(0.0), torch.tensor(-0.0)).changed == 1
    nan = torch.tensor(float("nan"))
    assert encode(nan, nan.clone()).changed == 0


def test_encode_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="differ"):
        encode(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="differ"):
        encode(torch.zeros(3), torch.zeros(3, dtype=torch.float64))


# --- malformed payloads ------------------------------------------------------------------


def header_fields(payload: torch.Tensor) -> dict:
    return dict(zip(FIELDS, HEADER.unpack(bytes(payload[:HEADER_BYTES].tolist())), strict=True))


def with_header(payload: torch.Tensor, **changes) -> torch.Tensor:
    fields = header_fields(payload)
    fields.update(changes)
    out = payload.clone()
    out[:HEADER_BYTES] = torch.tensor(list(HEADER.pack(*fields.values())), dtype=torch.uint8)
    return out


def assert_refused(target: torch.Tensor, kind, payload, match: str | None = None):
    before = bits(target)
    with pytest.raises(ValueError, match=match):
        apply(target, kind, payload)
    assert torch.equal(bits(target), before), "a refused payload wrote to the target"


def sample(kind: Kind, density=0.05, n=5000, dtype=torch.bfloat16, low_bytes=True, seed=0):
    base, new = make_pair(dtype, (n,), density, "low", seed)
    enc = encode(base, new, kinds=[kind], low_bytes=low_bytes)
    assert enc.kind == kind
    return base, new, enc


@pytest.mark.parametrize("kind", DELTA_KINDS)
@pytest.mark.parametrize("low_bytes", [True, False])
def test_truncated_or_extended_payload_is_refused(kind, low_bytes):
    base, _, enc = sample(kind, low_bytes=low_bytes)
    for cut in sorted(
        {0, 1, HEADER_BYTES - 1, HEADER_BYTES, enc.nbytes // 2, enc.nbytes - 8, enc.nbytes - 1}
    ):
        assert_refused(base.clone(), kind, enc.payload[:cut])
    assert_refused(base.clone(), kind, torch.cat([enc.payload, torch.zeros(8, dtype=torch.uint8)]))


@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_bad_header_fields_are_refused(kind):
    base, _, enc = sample(kind)
    h = header_fields(enc.payload)
    cases = {
        "magic": b"XX", "format": 99, "kind": 9, "esize": 4, "numel": h["numel"] + 1, "reserved": 1,
        "count": h["count"] + 1, "low": 2, "width": 3, "nexc": h["count"] + 1,
    }  # fmt: skip
    for name, value in cases.items():
        assert_refused(base.clone(), kind, with_header(enc.payload, **{name: value}))
    for huge in (2**63, 2**64 - 1, h["numel"] * 1000):
        assert_refused(base.clone(), kind, with_header(enc.payload, count=huge))
        assert_refused(base.clone(), kind, with_header(enc.payload, nexc=huge))
        assert_refused(base.clone(), kind, with_header(enc.payload, ncodes=huge))
    assert_refused(base.clone(), kind, with_header(enc.payload, count=h["count"] - 1))


def test_unknown_or_wrong_kind_and_wrong_target():
    base, _, enc = sample(Kind.INDEX)
    assert_refused(base.clone(), 99, enc.payload, "unknown kind")
    assert_refused(base.clone(), Kind.BITMASK, enc.payload, "kind")
    assert_refused(base.clone(), Kind.EMPTY, enc.payload)
    assert_refused(base.clone(), Kind.DENSE, enc.payload, "DENSE")
    assert_refused(base[:-1].clone(), Kind.INDEX, enc.payload, "elements")
    assert_refused(base.view(torch.int16).view(torch.uint8).clone(), Kind.INDEX, enc.payload, "elements")
    assert_refused(base.clone(), Kind.INDEX, enc.payload.to(torch.int16), "uint8")
    assert_refused(base.clone(), Kind.INDEX, None, "uint8")


def test_out_of_range_and_unsorted_positions_are_refused():
    base, _, enc = sample(Kind.INDEX, low_bytes=False)
    count = header_fields(enc.payload)["count"]
    positions = enc.payload[HEADER_BYTES : HEADER_BYTES + 4 * count].view(torch.int32)
    for bad in (base.numel(), -1, 2**31 - 1):
        p = enc.payload.clone()
        p[HEADER_BYTES : HEADER_BYTES + 4 * count].view(torch.int32)[-1] = bad
        assert_refused(base.clone(), Kind.INDEX, p, "INDEX positions")
    p = enc.payload.clone()
    p[HEADER_BYTES : HEADER_BYTES + 4 * count].view(torch.int32)[1] = positions[0]  # a duplicate
    assert_refused(base.clone(), Kind.INDEX, p, "INDEX positions")


def test_bad_bitmask_is_refused():
    base, _, enc = sample(Kind.BITMASK, n=5001)  # 5001 elements: the last mask byte has 7 spare bits
    last = HEADER_BYTES + (5001 + 7) // 8 - 1
    p = enc.payload.clone()
    p[last] |= 0x80
    assert_refused(base.clone(), Kind.BITMASK, p, "past element")
    p = enc.payload.clone()
    p[HEADER_BYTES] ^= 0x01  # one more or one fewer marked element than the header counts
    assert_refused(base.clone(), Kind.BITMASK, p, "marks")


@pytest.mark.parametrize("width_density", [(4, 0.3), (8, 0.05), (16, 0.001)])
def test_bad_gaps_are_refused(width_density, monkeypatch):
    width, density = width_density
    base, new = make_pair(torch.bfloat16, (20000,), density, "random", 3)
    monkeypatch.setattr(delta.encoder, "GAP_WIDTHS", (width,))
    enc = encode(base, new, kinds=[Kind.GAPS])
    h = header_fields(enc.payload)
    assert h["width"] == width
    section = (h["ncodes"] * width + 7) // 8
    p = enc.payload.clone()
    last = HEADER_BYTES + section - 1
    if width == 16:
        p[last - 1 : last + 1] = 0
    elif width == 8:
        p[last] = 0
    else:
        p[last] &= 0xF0 if h["ncodes"] % 2 else 0x0F
    assert_refused(base.clone(), Kind.GAPS, p, "GAPS")  # the last code is now an escape
    assert_refused(base.clone(), Kind.GAPS, p)
    p = enc.payload.clone()
    p[HEADER_BYTES : HEADER_BYTES + section] = 0xFF  # every code a maximal gap: past the end
    assert_refused(base.clone(), Kind.GAPS, p)
    for w in (0, 5, 32):
        assert_refused(base.clone(), Kind.GAPS, with_header(enc.payload, width=w), "gap width")


def test_bad_exceptions_are_refused():
    base = torch.zeros(4000, dtype=torch.int32)
    new = base.clone()
    new[::7] = 1
    new[::70] = 1 << 20  # the third byte changes: exceptions
    enc = encode(base, new)
    h = header_fields(enc.payload)
    assert h["low"] >= 1 and h["nexc"] > 0
    at = HEADER_BYTES + delta_format.pad8(
        {Kind.INDEX: h["count"] * 4, Kind.BITMASK: 500}.get(enc.kind, (h["ncodes"] * h["width"] + 7) // 8)
    )
    at += delta_format.pad8(h["count"] * h["low"])
    for bad in (h["count"], -1):
        p = enc.payload.clone()
        p[at : at + 4 * h["nexc"]].view(torch.int32)[-1] = bad
        assert_refused(base.clone(), enc.kind, p, "exception")
    roundtrip(base, new, enc)


@settings(deadline=None, max_examples=150)
@given(
    kind=st.sampled_from(DELTA_KINDS),
    seed=st.integers(0, 2**31),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_random_corruption_never_escapes_validation(kind, seed, flips):
    """Flipped bytes anywhere: either a ValueError with the target untouched, or a write
    that stays inside the target (values are not checksummed: that is ``verify``'s job)."""
    base, _, enc = sample(kind, n=3000, seed=seed % 1000)
    p = enc.payload.clone()
    for at, x in flips:
        p[at % p.numel()] ^= x
    target, outside = placed(base, "sliced")
    try:
        apply(target, kind, p)
    except ValueError:
        assert torch.equal(bits(target), bits(base))
    assert bool((bits(outside) == SENTINEL).all()), "wrote outside the target"


# --- digest ------------------------------------------------------------------------------


def test_digest_tells_bases_apart():
    a = {"w": torch.zeros(4, 3), "b": torch.tensor([0.0, 1.0])}
    d = digest(a)
    assert d.startswith("xxh3_64:") and d == digest(list(a.items())) == digest(clone_state(a))
    assert digest({"w": a["w"].t().contiguous().t(), "b": a["b"]}) == d  # layout does not matter
    assert digest({"w": a["w"], "b": torch.tensor([-0.0, 1.0])}) != d
    assert digest({"w": a["w"].reshape(3, 4), "b": a["b"]}) != d
    assert digest({"w": a["w"].to(torch.int32), "b": a["b"]}) != d
    assert digest({"v": a["w"], "b": a["b"]}) != d
    assert digest({"b": a["b"], "w": a["w"]}) != d  # order matters
    blake = digest(a, algorithm="blake2b")
    assert blake.startswith("blake2b:") and blake != d and blake == digest(a, algorithm="blake2b")
    with pytest.raises(ValueError, match="algorithm"):
        digest(a, algorithm="md5")


# --- AdamW versions ----------------------------------------------------------------------


def test_adamw_updates_change_a_few_percent():
    specs = [TensorSpec("layers.0.w", (64, 256), "bfloat16"), TensorSpec("layers.0.norm.weight", (256,), "bfloat16"),
             TensorSpec("step", (2,), "int64")]  # fmt: skip
    u = AdamWUpdates(specs, lr=1e-5, seed=0)
    tensors = u.tensors
    assert torch.equal(tensors["layers.0.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    prev = clone_state(tensors)
    assert u.step() is tensors and u.version == 1
    d = changed_fraction(prev, tensors)
    assert 0.01 < d < 0.5, d
    assert changed_elements(prev["step"], tensors["step"]) == 0
    assert u.masters["layers.0.w"].dtype == torch.float32
    again = AdamWUpdates(specs, lr=1e-5, seed=0)
    again.step()
    assert all(torch.equal(bits(again.tensors[k]), bits(tensors[k])) for k in tensors)  # seeded
    # A codec round trip on a real update.
    for name, t in tensors.items():
        roundtrip(prev[name], t, encode(prev[name], t))


def test_benchmark_rows_on_a_tiny_model():
    from weightsync.bench import delta_codec

    specs = [
        TensorSpec("layers.0.w", (128, 256), "bfloat16"),
        TensorSpec("layers.0.norm.weight", (256,), "bfloat16"),
    ]
    rows = delta_codec.adamw_rows(specs, [1e-5], steps=2, seed=0, log=lambda _: None)
    rows += delta_codec.synthetic_rows(specs, [0.05], seed=0, log=lambda _: None)
    for row in rows:
        assert row.bytes["chosen"] <= min(row.bytes.values()) and row.bytes["chosen"] < row.dense_bytes
        assert set(row.encode_cpu_s) == set(delta_codec.TIMED)
    assert "| AdamW lr 1e-05, step 2 |" in delta_codec.table(rows)
    assert len(rows[0].densities) == 2 and rows[0].densities[0] > rows[0].densities[1] > 0
