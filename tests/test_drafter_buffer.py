"""DrafterBuffer: pairing by true position (left padding), windows, FIFO cap, one-step offset sampling."""
import torch

from tlt.drafter_train.buffer import DrafterBuffer

H = 8


def fake_hidden(ids: torch.Tensor) -> torch.Tensor:
    """[L] -> [L, H] where row t encodes (true position t, token id x_t): misalignment shows up in the values."""
    L = ids.shape[0]
    h = torch.zeros(L, H)
    h[:, 0] = torch.arange(L)
    h[:, 1] = ids.float()
    return h


def seq(L: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 100, (L,), generator=torch.Generator().manual_seed(seed))


def check_pairs(windows, ids_of):
    """Every pair: input h_t (t = pos - 1), token x_{t+1}, target h_{t+1}, all from the same true position."""
    for w in windows:
        pos = w.positions
        assert torch.equal(w.hidden_in[:, 0].long(), pos - 1)
        assert torch.equal(w.target_hidden[:, 0].long(), pos)
        assert torch.equal(w.target_hidden[:, 1].long(), w.next_ids)  # h_{t+1} belongs to token x_{t+1}
        ids = ids_of(w)
        assert torch.equal(w.next_ids, ids[pos])


def test_left_padding_does_not_shift_pairing():
    prompts, responses = [5, 3, 7], [6, 9, 2]
    Pmax, Rmax = max(prompts), max(responses)
    B, L = 3, Pmax + Rmax
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    hidden = torch.full((B, L, H), -7.0)  # padding rows carry garbage
    true_seqs = []
    for b, (p, r) in enumerate(zip(prompts, responses)):
        s = seq(p + r, b)
        true_seqs.append(s)
        lo = Pmax - p  # left padding of the prompt, right padding after the response
        ids[b, lo:Pmax + r] = s
        mask[b, lo:Pmax + r] = 1
        hidden[b, lo:Pmax + r] = fake_hidden(s)
    buf = DrafterBuffer(max_tokens=10_000, window_len=4)
    assert buf.add_padded_batch(ids, hidden, mask, response_start=Pmax, step=0) == 3
    for s, p, r, true in zip(buf.samples, prompts, responses, true_seqs):
        assert s.response_start == p and s.length == p + r and torch.equal(s.token_ids, true)
        wins = [s.window(a, b) for _, a, b in buf.windows_of(s)]
        check_pairs(wins, lambda w: true)
        pos = torch.cat([w.positions for w in wins])
        # loss pairs: x_{t+1} runs over every response token (h is known at every position here)
        assert torch.equal(pos, torch.arange(p, p + r))
        assert all(w.loss_mask.all() for w in wins)
    # identical to adding the unpadded sequences directly
    direct = DrafterBuffer(max_tokens=10_000, window_len=4)
    for true, p in zip(true_seqs, prompts):
        direct.add(true, fake_hidden(true), p, 0)
    for a, b in zip(buf.samples, direct.samples):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.token_ids, b.token_ids)


def test_engine_response_only_hidden_and_loss_mask():
    """Engine keeps h for positions P-1 .. L-2 (the states that produced each output token)."""
    P, R = 6, 10
    ids = seq(P + R, 1)
    h = fake_hidden(ids)[P - 1:P + R - 1]
    buf = DrafterBuffer(max_tokens=1000, window_len=512)
    s = buf.add(ids, h, response_start=P, rl_step=0, hidden_start=P - 1)
    (_, a, b), = buf.windows_of(s)
    w = s.window(a, b)
    check_pairs([w], lambda w: ids)
    assert torch.equal(w.positions, torch.arange(P, P + R - 1)) and w.loss_mask.all()
    assert buf.num_train_tokens() == R - 2 + 1  # pairs t = P-1 .. L-3
    # prompt pairs present (hidden_start=0) are context only: loss_mask False there
    s2 = buf.add(ids, fake_hidden(ids), response_start=P, rl_step=0)
    w2 = s2.window(0, s2.pair_range[1])
    assert torch.equal(w2.loss_mask, w2.positions >= P)


def test_windows_keep_true_positions():
    P, R = 20, 1200
    ids = seq(P + R, 2)
    buf = DrafterBuffer(max_tokens=100_000, window_len=512, dtype=torch.float32)  # fp32: positions > 256 exact
    s = buf.add(ids, fake_hidden(ids), P, 0)
    spans = buf.windows_of(s)
    assert [b - a for _, a, b in spans] == [512, 512, R - 1024]
    wins = [s.window(a, b) for _, a, b in spans]
    check_pairs(wins, lambda w: ids)
    assert [int(w.positions[0]) for w in wins] == [P, P + 512, P + 1024]
    assert DrafterBuffer(max_tokens=100_000).add(ids, fake_hidden(ids), P, 0).hidden.dtype == torch.bfloat16


def test_fifo_token_cap():
    buf = DrafterBuffer(max_tokens=100, window_len=16)
    for i in range(10):
        ids = seq(30, i)
        buf.add(ids, fake_hidden(ids), 10, rl_step=i)
        assert buf.num_tokens <= 100
    assert [s.rl_step for s in buf.samples] == [7, 8, 9]  # oldest evicted first
    assert buf.num_tokens == 90


def test_offset_sampling_mixes_previous_long_responses():
    buf = DrafterBuffer(max_tokens=1_000_000, window_len=64, offset_frac=0.5, long_quantile=0.5)
    P = 4
    for i, R in enumerate([20, 30, 40, 400, 500, 600]):  # step 0: three short, three long
        ids = seq(P + R, i)
        buf.add(ids, fake_hidden(ids), P, rl_step=0)
    for i in range(6):  # step 1 so far: only the early (short) finishers
        ids = seq(P + 20, 100 + i)
        buf.add(ids, fake_hidden(ids), P, rl_step=1)
    long0 = {id(s) for s in buf.long_samples(0)}
    assert {s.response_len for s in buf.samples if id(s) in long0} == {400, 500, 600}

    def source(w):  # (step, response length) of the sample a window came from
        for s in buf.samples:
            if w.hidden_in.untyped_storage().data_ptr() == s.hidden.untyped_storage().data_ptr():
                return s.rl_step, s.response_len
        raise AssertionError("window not from the buffer")

    wins = buf.sample_windows(max_tokens=200, step=1, generator=torch.Generator().manual_seed(0))
    srcs = [source(w) for w in wins]
    prev = sum(len(w) for w, s in zip(wins, srcs) if s[0] == 0)
    cur = sum(len(w) for w, s in zip(wins, srcs) if s[0] == 1)
    assert all(r >= 400 for st, r in srcs if st == 0)  # never the previous step's short ones
    assert 50 <= prev <= 100 and 50 <= cur <= 100
    batch = buf.sample_batch(num_rows=2, batch_tokens=128, step=1, generator=torch.Generator().manual_seed(0))
    assert batch.hidden_in.shape[1:] == (128, H) and batch.num_loss_tokens > 0


def test_holdout_is_never_trained_on():
    buf = DrafterBuffer(max_tokens=100_000, window_len=32, holdout_every=3)
    for i in range(9):
        ids = seq(40, i)
        buf.add(ids, fake_hidden(ids), 5, rl_step=0)
    held = [s for s in buf.samples if s.heldout]
    assert len(held) == 3
    ptrs = {s.hidden.untyped_storage().data_ptr() for s in held}
    wins = buf.sample_windows(10_000, step=0)
    assert all(w.hidden_in.untyped_storage().data_ptr() not in ptrs for w in wins)
    assert buf.heldout_batch(batch_tokens=64, max_tokens=1000).num_loss_tokens == 3 * 35
