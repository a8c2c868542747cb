"""TOPLOC proofs: field arithmetic against a literal port, honest checks pass, tampering and
malformed proofs are rejected with a reason."""

import random

import pytest
import torch

from intellect.toploc.field import MOD, evaluate, interpolate, inverses
from intellect.toploc.proofs import (
    ToplocConfig,
    build_proofs,
    check_chunks,
    decode_proofs,
    injective_moduli,
    magnitude_candidates,
    n_chunks,
    proof_size,
)


def literal_coefficients(x, y):
    """Divided differences then monomial expansion, one scalar at a time (the reference's loops)."""
    n = len(x)
    dd = [v % MOD for v in y]
    for j in range(1, n):
        for i in range(n - 1, j - 1, -1):
            dd[i] = (dd[i] - dd[i - 1]) % MOD * pow((x[i] - x[i - j]) % MOD, MOD - 2, MOD) % MOD
    coeffs, factor = [0] * n, [1] + [0] * (n - 1)
    for i in range(n):
        coeffs = [(c + dd[i] * f) % MOD for c, f in zip(coeffs, factor)]
        factor = [((factor[t - 1] if t else 0) - x[i] * factor[t]) % MOD for t in range(n)]
    return coeffs


def acts(tokens=64, hidden=256, seed=0):
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_inverse_table():
    inv = inverses()
    a = torch.arange(1, MOD)
    assert bool((a * inv[1:] % MOD == 1).all())


def test_vectorized_interpolation_matches_the_literal_port():
    rng = random.Random(0)
    for k in (1, 2, 5, 17):
        xs = [rng.sample(range(MOD), k) for _ in range(4)]
        ys = [[rng.randrange(65536) for _ in range(k)] for _ in range(4)]
        got = interpolate(torch.tensor(xs), torch.tensor(ys))
        assert got.tolist() == [literal_coefficients(x, y) for x, y in zip(xs, ys)]
        assert evaluate(got, torch.tensor(xs)).tolist() == [[v % MOD for v in y] for y in ys]


def test_injective_modulus_steps_down_only_when_needed():
    idx = torch.tensor([[3, 3 + MOD, 9], [1, 2, 3]])
    m = injective_moduli(idx)
    assert m[1] == MOD and m[0] < MOD
    assert len(set((idx[0] % m[0]).tolist())) == 3


def test_sizes():
    assert proof_size(128) == 258
    assert len(build_proofs(acts(70, 128), chunk=32, k=128)) == n_chunks(70, 32) * 258


def test_honest_recomputation_passes_on_every_path():
    a = acts(100, 256)
    assert all(r.ok and r.exp_mismatches == 0 and r.mant_err_mean == 0 for r in check_chunks(a, build_proofs(a)))


def test_a_modulus_below_the_prime_is_evaluated_at_index_mod_m():
    """The reference's Python verify path evaluates at the raw index and rejects these honest chunks."""
    a = acts(32, 4096, seed=1).float()
    a[0, 7] = a[16, 7] = 0  # make room, then plant two top values 65497 apart in the flat chunk
    flat = a.view(-1)
    flat[100], flat[100 + MOD] = 50.0, -60.0
    a = a.to(torch.bfloat16)
    blob = build_proofs(a)
    moduli, _ = decode_proofs(blob, 128)
    assert int(moduli[0]) < MOD
    assert [r.ok for r in check_chunks(a, blob)] == [True]


def test_small_noise_passes_and_large_noise_or_another_tensor_fails():
    base = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    blob = build_proofs(base.to(torch.bfloat16))
    noise = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    for rel, expect in ((1e-3, True), (1e-2, True), (0.2, False)):
        got = check_chunks((base * (1 + rel * noise)).to(torch.bfloat16), blob)
        assert all(r.ok == expect for r in got), (rel, got)
    other = check_chunks(acts(64, 512, seed=9), blob)
    assert all(r.reason == "exponent" for r in other)


def test_sign_flip_is_caught():
    a = acts()
    got = check_chunks(-a, build_proofs(a))
    assert [r.reason for r in got] == ["sign", "sign"] and all(r.exp_mismatches == 0 for r in got)
    assert all(r.ok for r in check_chunks(-a, build_proofs(a), cfg=ToplocConfig(max_sign_mismatches=128)))


def test_malformed_proofs_are_reasons_not_crashes():
    a = acts()
    blob = build_proofs(a)
    size = proof_size(128)
    null = bytes(size) + blob[size:]
    assert [r.reason for r in check_chunks(a, null)] == ["null_proof", None]
    assert {r.reason for r in check_chunks(a, blob[:-1])} == {"malformed"}
    assert {r.reason for r in check_chunks(a, blob + blob[:size])} == {"proof_count"}
    assert {r.reason for r in check_chunks(a, blob[:size])} == {"proof_count"}
    assert {r.reason for r in check_chunks(a, b"")} == {"proof_count"}
    big = bytearray(blob)
    big[2:4] = (65535).to_bytes(2, "big")  # a coefficient outside the field
    assert [r.reason for r in check_chunks(a, bytes(big))] == ["malformed", None]
    small = bytearray(blob)
    small[0:2] = (5).to_bytes(2, "big")  # a modulus too small to be injective on k indices
    assert [r.reason for r in check_chunks(a, bytes(small))] == ["malformed", None]
    assert {r.reason for r in check_chunks(a.float(), blob)} == {"dtype"}
    assert {r.reason for r in check_chunks(a[0], blob)} == {"dtype"}
    assert {r.reason for r in check_chunks(a, "not bytes")} == {"malformed"}


def test_build_refuses_what_it_cannot_commit_to():
    with pytest.raises(TypeError, match="bf16"):
        build_proofs(acts().float())
    with pytest.raises(ValueError, match="fewer than k"):
        build_proofs(acts(1, 64), k=128)


def test_evaluate_matches_integer_horner_on_the_whole_field():
    g = torch.Generator().manual_seed(5)
    for k in (1, 2, 3, 128):
        coeffs = torch.randint(0, 65536, (8, k), generator=g)  # includes values outside the field
        x = torch.randint(0, 1 << 20, (8, 16), generator=g)
        want = [[sum(int(c) * pow(int(v), t, MOD) for t, c in enumerate(row)) % MOD for v in xs]
                for row, xs in zip(coeffs, x)]
        assert evaluate(coeffs, x).tolist() == want


def test_an_empty_output_carries_no_proof():
    empty = torch.empty(0, 128, dtype=torch.bfloat16)
    assert build_proofs(empty) == b"" and check_chunks(empty, b"") == []
    assert [r.reason for r in check_chunks(empty, build_proofs(acts(32, 128)))] == ["proof_count"]


def test_the_candidate_search_finds_the_top_k_with_all_its_ties():
    """Against a brute force on random bits (signs, ties, sizes that are no multiple of the fan)."""
    g = torch.Generator().manual_seed(6)
    for _ in range(200):
        rows, n = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(4, 5000, (1,), generator=g))
        k = int(torch.randint(1, min(n, 200) + 1, (1,), generator=g))
        span = int(torch.randint(1, 65536, (1,), generator=g))  # small spans: many ties
        raw = (torch.randint(0, span, (rows, n), generator=g) - 32768).to(torch.int16)
        got = magnitude_candidates(raw, k, fan=int(torch.randint(2, 9, (1,), generator=g)))
        keys = raw.long() & 0x7FFF
        kth = keys.topk(k, -1).values[:, -1:]
        for r in range(rows):
            assert sorted(p for p in got[r].tolist() if p >= 0) == (keys[r] >= kth[r]).nonzero()[:, 0].tolist()


def test_ties_at_the_kth_magnitude_never_count_against_an_honest_prover():
    g = torch.Generator().manual_seed(7)
    for a in (torch.randint(-1, 2, (64, 128), generator=g).float(),   # thousands tied: the prover's kernel decides
              torch.randint(-8, 9, (64, 4096), generator=g).float(),  # hundreds tied at the k-th
              torch.zeros(40, 128)):
        a = a.to(torch.bfloat16)
        assert all(r.ok and r.exp_mismatches == 0 for r in check_chunks(a, build_proofs(a)))
