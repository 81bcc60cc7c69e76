"""Packed documents (memo.documents): loss and every gradient against the plain-autograd reference with an explicit
block-diagonal causal mask and positions restarting per document, for every memory strategy, tile and per-layer
plan; one document per sequence is today's path bitwise; transformers' own packed forward (position_ids) agrees.
The lengths of a corpus's documents (`DocumentLengths`): their expected attention work against brute force."""

import json

import numpy as np
import pytest
import ranks
import torch
from test_layer_gradients import DEVICE, FP32_TOL, POLICIES, TILED, _config, _pair

from memo.documents import DocumentLengths, Documents, attended_tokens, document_positions
from memo.plan.phases import attach
from memo.train.data import write_token_file

# two sequences of 29 tokens: documents of every size, one-token ones among them, cut differently per row. RoPE
# is relative, so restarting positions shows only where the frequencies depend on the length: dynamic RoPE
# stretches past 24 positions, which these documents never reach (the sequences do)
LAYOUTS = [(5, 1, 12, 1, 1, 9), (10, 19)]
ONE_TOKEN_DOCS = [(1,) * 7 + (22,), (3, 1, 25)]
WHOLE_AND_PACKED = [(29,), (3, 26)]


def _positions(layout: list[tuple[int, ...]]) -> torch.Tensor:
    """Returns (b, s) positions within documents of the given lengths, per sequence."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in layout]).to(DEVICE)


def _batch(layout):
    positions = _positions(layout)
    ids = torch.randint(0, 256, positions.shape, device=DEVICE)
    labels = ids.masked_fill(positions == 0, -100)  # a document's first token is no target of the one before
    return ids, labels, positions


def _check_against_reference(preset: str, policy: str, layout) -> None:
    ref, model = _pair(preset, policy)
    ids, labels, positions = _batch(layout)
    ref_loss = ref(ids, labels=labels, positions=positions)
    ref_loss.backward()
    for _ in range(2):  # the second step reuses the sized buffers and host pool
        model.zero_grad()
        loss = model(ids, labels=labels, positions=positions)
        loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5 if DEVICE.type == "cpu" else 1e-4)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, **FP32_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt", "qwen3-like", "dynamic-rope"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_packed_documents_match_the_masked_reference(preset, policy):
    _check_against_reference(preset, policy, LAYOUTS)


@pytest.mark.parametrize("preset", ["tiny", "qwen2-like"])
@pytest.mark.parametrize("policy", list(TILED))
def test_tiles_and_per_layer_plans_over_packed_documents_match_the_reference(preset, policy):
    _check_against_reference(preset, policy, LAYOUTS)


@pytest.mark.parametrize("policy", ["none", "memo-a0.37", "plan-tile-6"])
@pytest.mark.parametrize("layout", [ONE_TOKEN_DOCS, WHOLE_AND_PACKED])
def test_one_token_documents_and_whole_sequences_match_the_reference(policy, layout):
    _check_against_reference("tiny", policy, layout)


@pytest.mark.parametrize("policy", ["none", "memo-a0.37-tile-8", "plan-tile-6"])
def test_one_document_per_sequence_is_todays_path_bitwise(policy):
    _, model = _pair("tiny", policy)
    ids = torch.randint(0, 256, (2, 29), device=DEVICE)
    results = []
    for positions in (None, _positions([(29,), (29,)])):
        model.zero_grad()
        loss = model(ids, labels=ids, positions=positions)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_a_packed_document_scores_as_it_does_alone():
    """The no-grad path (evaluation) too: each document's logits are those of the document alone."""
    _, model = _pair("qwen3-like", "memo-a0.37-tile-8")
    layout = [(6, 11, 1, 11)]
    ids = torch.randint(0, 256, (1, 29), device=DEVICE)
    with torch.no_grad():
        packed = model(ids, positions=_positions(layout))
        at = 0
        for n in layout[0]:
            torch.testing.assert_close(packed[:, at : at + n], model(ids[:, at : at + n]), **FP32_TOL)
            at += n


def test_documents_are_read_from_positions_and_bad_positions_are_refused():
    positions = _positions([(2, 3), (1, 1, 3)]).cpu()
    docs = Documents.of(positions, 2, 5, "cpu")
    assert docs.bounds == ((0, 2), (2, 5), (5, 6), (6, 7), (7, 10)) and docs.max_length == 3
    assert docs.cu_seqlens.tolist() == [0, 2, 5, 6, 7, 10] and docs.cu_seqlens.dtype == torch.int32
    assert Documents.of(torch.arange(5).expand(2, 5), 2, 5, "cpu") is None  # one document each: the plain path
    starts = torch.zeros(2, 5, dtype=torch.bool)
    starts[0, 2] = starts[1, 1] = starts[1, 2] = True
    assert torch.equal(document_positions(starts), positions)
    for bad in (torch.tensor([[0, 1, 3, 4, 5]]), torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[0, 1, -1, 0, 1]])):
        with pytest.raises(ValueError, match="count 0, 1, 2"):
            Documents.of(bad, 1, 5, "cpu")
    assert attended_tokens(positions) == (4 + 9 + 1 + 1 + 9) / 10  # Σ dᵢ² / tokens: what the MFU counts
    with pytest.raises(ValueError, match=r"\(batch, tokens\) = \(1, 6\)"):
        Documents.of(torch.zeros(1, 5, dtype=torch.long), 1, 6, "cpu")


def test_the_phase_planner_runs_packed_batches_unplanned_and_exact(caplog):
    ref, model = _pair("tiny", "memo-a0.37-tile-8")
    attach(model)
    ids, labels, positions = _batch(LAYOUTS)
    model(ids, labels=labels, positions=positions).backward()
    assert "packed batches use the allocator" in caplog.text
    ref(ids, labels=labels, positions=positions).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, **FP32_TOL, msg=lambda m: f"{name}: {m}")


def test_bf16_packed_gradients_are_as_close_to_fp32_as_the_bf16_reference():
    ref32, model = _pair("tiny", "memo-a0.37-tile-8")
    model.to(torch.bfloat16)
    ids, labels, positions = _batch(LAYOUTS)
    ref16 = type(ref32)(_config("tiny"), attention="sdpa").to(DEVICE, torch.bfloat16)
    ref16.load_state_dict(model.state_dict())
    for m in (ref32, ref16, model):
        m(ids, labels=labels, positions=positions).backward()
    exact, ref16_params = dict(ref32.named_parameters()), dict(ref16.named_parameters())
    for name, p in model.named_parameters():
        truth = exact[name].grad
        err = (p.grad.float() - truth).norm() / truth.norm()
        ref_err = (ref16_params[name].grad.float() - truth).norm() / truth.norm()
        assert err <= 1.5 * ref_err + 0.005, f"{name}: bf16 memo error {err:.4f}, bf16 reference error {ref_err:.4f}"


# ---- transformers' own packed forward (position_ids, no attention mask: a block-diagonal causal mask) -----------
PACKED = [(5, 14, 1, 12), (1, 30, 1)]  # 32 tokens: under sp=2 the first row's second document spans both ranks


def _hf_batch():
    positions = _positions(PACKED).cpu()
    ids = torch.randint(0, 128, positions.shape)
    return ids, ids.masked_fill(positions == 0, -100), positions


def _hf_loss(hf, ids, labels, positions):
    return hf(ids, labels=labels, position_ids=positions, use_cache=False).loss


@pytest.mark.parametrize("family, rope", [("llama", "llama3"), ("qwen2", "yarn"), ("qwen3", "dynamic")])
@pytest.mark.parametrize("policy", ["none", "memo-a0.5"])
def test_packed_documents_match_transformers_packed_forward(tmp_path, family, rope, policy):
    import test_hf

    hf = test_hf._saved(tmp_path, family, rope, use_sliding_window=False) if family == "qwen2" else None
    hf = hf or test_hf._saved(tmp_path, family, rope)
    model = test_hf.from_hf(tmp_path, policy=test_hf.POLICIES[policy])
    ids, labels, positions = _hf_batch()
    with torch.no_grad():
        logits = hf(ids, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(model(ids, positions=positions), logits, **test_hf.LOGITS_TOL)
        assert not torch.allclose(model(ids), logits, **test_hf.LOGITS_TOL)  # packing changed transformers' answer
    hf_loss = _hf_loss(hf, ids, labels, positions)
    hf_loss.backward()
    loss = model(ids, labels=labels, positions=positions)
    loss.backward()
    torch.testing.assert_close(loss, hf_loss, rtol=1e-6, atol=1e-6)
    test_hf._assert_grads_match({n: p.grad for n, p in model.named_parameters()}, hf)


def _sp_rank(rank: int, port: int, root: str) -> None:
    from datetime import timedelta

    import test_hf
    import torch.distributed as dist

    from memo.parallel import full_gradients, init_mesh, parallelize, shard_batch

    ranks.join(rank, 2, port)
    try:
        mesh = init_mesh(2, timeout=timedelta(seconds=60))
        for policy in ("none", "memo-a0.5-all-layers"):
            hf = test_hf.transformers.AutoModelForCausalLM.from_pretrained(root, attn_implementation="eager").eval()
            model = parallelize(test_hf.from_hf(root, policy=test_hf.POLICIES[policy]), mesh)
            torch.manual_seed(1)
            ids, labels, positions = _hf_batch()
            hf_loss = _hf_loss(hf, ids, labels, positions)
            hf_loss.backward()
            local_ids, targets = shard_batch(ids, labels, mesh)
            loss = model(local_ids, targets=targets, positions=positions)  # every rank: the whole sequence's
            loss.backward()
            torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"sp=2 {policy} loss: {m}")
            test_hf._assert_grads_match(full_gradients(model), hf, f"sp=2 {policy}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_document_across_the_ulysses_rank_boundary_matches_transformers(tmp_path, free_port):
    import test_hf
    import torch.multiprocessing as mp

    test_hf._saved(tmp_path, "qwen3", "dynamic", num_hidden_layers=4)
    mp.spawn(_sp_rank, args=(free_port(), str(tmp_path)), nprocs=2)


# ---- document lengths: the attention work of sequences cut from a corpus's documents ----------------------------


def _pieces(lengths: list[int], start: int, seq: int) -> list[int]:
    """Returns the lengths of the pieces of documents in the window [start, start + seq) of the documents' stream
    taken as a cycle, walked token by token."""
    first = set(np.cumsum([0, *lengths[:-1]]).tolist())
    total, pieces = sum(lengths), []
    for i in range(seq):
        if i == 0 or (start + i) % total in first:
            pieces.append(0)
        pieces[-1] += 1
    return pieces


@pytest.mark.parametrize("seq", [1, 4, 10, 29, 30, 64])
def test_expected_squares_of_a_histogram_are_the_mean_over_every_cut_of_the_stream(seq):
    lengths = [3, 7, 1, 12, 5, 1, 1]  # 30 tokens: windows shorter and longer than the stream
    brute = [sum(d * d for d in _pieces(lengths, start, seq)) for start in range(sum(lengths))]
    assert DocumentLengths.of_lengths(lengths).squares(seq) == pytest.approx(sum(brute) / len(brute), rel=1e-12)
    shuffled = DocumentLengths.of_lengths(lengths[::-1])  # the order of the documents does not matter
    assert shuffled.squares(seq) == pytest.approx(sum(brute) / len(brute), rel=1e-12)


def test_sequences_cut_at_fixed_bounds_of_a_long_stream_average_to_the_expectation():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, size=40_000)  # 14M tokens
    seq = 2048
    bounds = np.union1d(np.cumsum(lengths)[:-1], np.arange(seq, lengths.sum(), seq))
    pieces = np.diff(np.concatenate(([0], bounds, [lengths.sum()])))
    cut = np.concatenate(([0], bounds))  # each piece's start: it belongs to the sequence its start is in
    whole = lengths.sum() // seq
    squares = np.bincount(cut // seq, weights=pieces.astype(float) ** 2)[:whole]
    assert squares.mean() == pytest.approx(DocumentLengths.of_lengths(lengths).squares(seq), rel=0.01)


def test_documents_of_a_mean_length_fill_a_sequence_whole_and_the_last_one_cut():
    assert DocumentLengths(mean=4).squares(10) == 4 * 4 + 4 * 4 + 2 * 2  # 10 = 2·4 + 2
    assert DocumentLengths(mean=5).squares(10) == 2 * 5 * 5
    assert DocumentLengths(mean=1).squares(10) == 10  # each token attends to itself
    assert DocumentLengths(mean=10).squares(10) == DocumentLengths(mean=1 << 20).squares(10) == 100  # unpacked
    assert DocumentLengths(mean=1024).attended(1 << 20) == 1024  # what a token attends to
    # the same documents as a histogram are a stream cut anywhere, not from a document's start: a cut u tokens into
    # one splits it (u uniform in 0..3), so 64·4 tokens hold 63 whole ones and the two pieces, (4 - u)² + u²
    assert DocumentLengths.of_lengths([4] * 1000).squares(4 * 64) == 63 * 16 + (16 + 10 + 8 + 10) / 4


def test_document_lengths_of_a_token_file_are_its_documents(tmp_path):
    texts = ["a" * 5, "bb" * 40, "c" * 7, "d" * 300, "e" * 7]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    write_token_file(tmp_path / "d.jsonl", tmp_path / "c.bin")  # bytes: one token per character
    documents = DocumentLengths.of_file(tmp_path / "c.bin")
    assert documents.histogram == ((5, 1), (7, 2), (80, 1), (300, 1)) and documents.mean_tokens == 399 / 5
    lengths = [len(t) for t in texts]
    for seq in (64, 512):
        brute = [sum(d * d for d in _pieces(lengths, start, seq)) for start in range(sum(lengths))]
        assert documents.squares(seq) == pytest.approx(sum(brute) / len(brute), rel=1e-12)
    np.save(tmp_path / "one.npy", np.arange(100))  # a .npy without document starts: one document
    assert DocumentLengths.of_file(tmp_path / "one.npy").histogram == ((100, 1),)
    (tmp_path / "c.docs.npy").unlink()  # a .bin without them would read as one document: refused
    with pytest.raises(ValueError, match=r"`--document-lengths` '.*c.bin' has no c.docs.npy \(its document bound"):
        DocumentLengths.of_file(tmp_path / "c.bin")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: DocumentLengths(mean=0), "`--mean-document-tokens` must be a positive integer, got 0"),
        (lambda p: DocumentLengths(mean=1.5), "`--mean-document-tokens` must be a positive integer, got 1.5"),
        (lambda p: DocumentLengths(), "one of a mean length and a histogram"),
        (lambda p: DocumentLengths.of_file(p / "missing.bin"), "`--document-lengths` file"),
        (lambda p: DocumentLengths.of_file(p / "d.jsonl"), "`--document-lengths` takes a memo token file"),
        (lambda p: DocumentLengths.of_file(p / "c.bin"), "`--document-lengths`: a .bin token file needs its sidecar"),
    ],
)
def test_bad_document_lengths_are_one_line_naming_the_flag(tmp_path, make, message):
    (tmp_path / "d.jsonl").write_text('{"text": "abc"}\n')
    (tmp_path / "c.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="^[^\n]*$") as err:
        make(tmp_path)
    assert message in str(err.value)
