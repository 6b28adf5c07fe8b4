"""CausalWan: the cached chunk loop, the block-causal pass and the teacher-forced pass agree (values and
gradients), are causal, reuse the stock Wan faithfully (rotary offsets, modulation, unpatchify), and the
cache can be re-routed; tiny random weights on CPU."""

import copy
import json

import pytest
import torch

from mmrl.policies.video.causal_wan import CONFIG_NAME, CausalWan, KVCache, build_tiny_wan

torch.set_num_threads(1)

B, C, CF, K, HW, L = 2, 3, 2, 3, 8, 5  # batch, channels, chunk frames, chunks, height=width, text tokens


@pytest.fixture(scope="module")
def model():
    return build_tiny_wan(chunk_frames=CF, seed=0).eval()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, C, K * CF, HW, HW, generator=g)
    clean = torch.randn(B, C, K * CF, HW, HW, generator=g)
    text = torch.randn(B, L, 32, generator=g)
    t = torch.tensor([0.3, 0.8])
    t_chunks = torch.rand(B, K, generator=g)
    return x, clean, text, t, t_chunks


def chunk(x, k):
    return x[:, :, k * CF:(k + 1) * CF]


def chunk_loop(model, x, t, text, cache=None):
    """forward_chunk chunk by chunk, writing each chunk (same input, same t) into the cache."""
    cache = KVCache() if cache is None else cache
    outs = []
    for k in range(x.shape[2] // CF):
        tk = t[:, k] if t.dim() == 2 else t
        outs.append(model.forward_chunk(chunk(x, k), tk, text, cache, k, write_cache=True))
    return torch.cat(outs, 2), cache


@pytest.mark.parametrize("per_chunk", [False, True])
def test_cached_chunks_equal_block_causal(model, data, per_chunk):
    x, _, text, t, t_chunks = data
    t = t_chunks if per_chunk else t
    with torch.no_grad():
        looped, cache = chunk_loop(model, x, t, text)
        full = model.forward_block_causal(x, t, text)
    assert full.shape == x.shape
    assert cache.num_chunks == K and cache.num_frames == K * CF and cache.positions == [0, 1, 2]
    k0, _ = cache.chunk(0)[0]
    assert k0.shape == (B, 2, CF * (HW // 2) ** 2, 16)  # [B, heads, tokens of a chunk, head_dim]
    torch.testing.assert_close(looped, full, atol=1e-5, rtol=1e-5)


def test_teacher_forced_equals_clean_cache_loop(model, data):
    x, clean, text, _, t = data
    with torch.no_grad():
        tf = model.forward_teacher_forced(clean, x, t, text)
        cache, outs = KVCache(), []
        for k in range(K):
            outs.append(model.forward_chunk(chunk(x, k), t[:, k], text, cache, k))  # cache = clean chunks < k
            model.forward_chunk(chunk(clean, k), 0.0, text, cache, k, write_cache=True)
    torch.testing.assert_close(tf, torch.cat(outs, 2), atol=1e-5, rtol=1e-5)
    # and the clean history matters: other clean chunks change noisy chunk 2's velocity
    with torch.no_grad():
        other = model.forward_teacher_forced(clean.flip(0), x, t, text)
    assert (chunk(other, 2) - chunk(tf, 2)).abs().max() > 1e-3


def test_block_causal_is_causal(model, data):
    x, _, text, t, _ = data
    x2 = x.clone()
    x2[:, :, 2 * CF:3 * CF] += torch.randn_like(x2[:, :, 2 * CF:3 * CF])
    with torch.no_grad():
        a, b = model.forward_block_causal(x, t, text), model.forward_block_causal(x2, t, text)
    torch.testing.assert_close(a[:, :, :2 * CF], b[:, :, :2 * CF], atol=1e-6, rtol=0)
    assert (chunk(a, 2) - chunk(b, 2)).abs().max() > 1e-3
    # and history is attended at all: changing chunk 0 moves chunk 2
    x3 = x.clone()
    x3[:, :, :CF] += 1.0
    with torch.no_grad():
        c = model.forward_block_causal(x3, t, text)
    assert (chunk(a, 2) - chunk(c, 2)).abs().max() > 1e-3


def test_one_chunk_equals_stock_forward(model, data):
    x, _, text, t, _ = data
    whole = CausalWan(model.transformer, chunk_frames=K * CF)
    with torch.no_grad():
        stock = model.transformer(hidden_states=x, timestep=t * whole.num_train_timesteps,
                                  encoder_hidden_states=text).sample
        ours = whole.forward_block_causal(x, t, text)
        # a one-chunk forward_chunk is the same thing
        ours_chunk = whole.forward_chunk(x, t, text, None, 0)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_chunk, stock, atol=1e-5, rtol=1e-5)


def test_rotary_offset_matters(model, data, monkeypatch):
    x, _, text, t, _ = data
    with torch.no_grad():
        cache = KVCache()
        model.forward_chunk(chunk(x, 0), t, text, cache, 0, write_cache=True)
        right = model.forward_chunk(chunk(x, 1), t, text, cache, 1)
        rotary = model._rotary
        monkeypatch.setattr(model, "_rotary", lambda start, n, h, w: rotary(0, n, h, w))  # offset dropped
        wrong = model.forward_chunk(chunk(x, 1), t, text, cache, 1)
        monkeypatch.undo()
        full = model.forward_block_causal(x[:, :, :2 * CF], t, text)
    torch.testing.assert_close(right, chunk(full, 1), atol=1e-5, rtol=1e-5)
    assert (wrong - right).abs().max() > 1e-3


def test_save_load_roundtrip_and_errors(model, data, tmp_path):
    x, _, text, t, _ = data
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / CONFIG_NAME).read_text())["chunk_frames"] == CF
    loaded = CausalWan.from_pretrained(tmp_path / "m").eval()
    assert loaded.chunk_frames == CF
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_block_causal(x, t, text), model.forward_block_causal(x, t, text),
                                   atol=0, rtol=0)
    assert CausalWan.from_pretrained(tmp_path / "m", chunk_frames=3).chunk_frames == 3

    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        CausalWan.from_pretrained(missing, CF)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json.*empty"):
        CausalWan.from_pretrained(tmp_path / "empty", CF)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights.*no_weights"):
        CausalWan.from_pretrained(no_weights, CF)
    (no_weights / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="no_weights"):
        CausalWan.from_pretrained(no_weights, CF)


def test_gradients_match_through_the_cache(model, data):
    x, _, text, t, _ = data
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))

    def grads(fn):
        model.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_(True)
        out = fn(xin)
        (chunk(out, 2) * chunk(w, 2)).sum().backward()  # only the last chunk's output in the loss
        return xin.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    gx_loop, gp_loop = grads(lambda xin: chunk_loop(model, xin, t, text)[0])
    gx_full, gp_full = grads(lambda xin: model.forward_block_causal(xin, t, text))
    model.transformer.enable_gradient_checkpointing()  # recompute must see the cache as it was
    try:
        gx_ckpt, gp_ckpt = grads(lambda xin: chunk_loop(model, xin, t, text)[0])
    finally:
        model.transformer.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(gx_ckpt, gx_loop, atol=1e-6, rtol=1e-5)
    # the loss sees chunks 0-1 only through the cached K/V: their input gradient is nonzero and equal
    assert chunk(gx_loop, 0).abs().max() > 1e-4
    torch.testing.assert_close(gx_loop, gx_full, atol=1e-5, rtol=1e-4)
    assert gp_loop.keys() == gp_full.keys() and len(gp_loop) == len(list(model.parameters()))
    for name in gp_loop:
        torch.testing.assert_close(gp_loop[name], gp_full[name], atol=1e-5, rtol=1e-4, msg=name)


def test_cache_take_select_clone(model, data):
    x, _, text, t, _ = data
    with torch.no_grad():
        _, cache3 = chunk_loop(model, x, t, text)
        _, cache01 = chunk_loop(model, x[:, :, :2 * CF], t, text)
        ref = model.forward_chunk(chunk(x, 2), t, text, cache01, 2)
        # a cache built from chunks [0, 1] of the 3-chunk cache
        for sub in (cache3.take([0, 1]), cache3.chunk_slice(0, 2)):
            assert sub.positions == [0, 1] and cache3.num_chunks == 3
            torch.testing.assert_close(model.forward_chunk(chunk(x, 2), t, text, sub, 2), ref, atol=1e-6, rtol=0)
        # reordering keeps each chunk's own rotary position (baked into the keys): same output
        swapped = cache3.take([1, 0])
        assert swapped.positions == [1, 0]
        torch.testing.assert_close(model.forward_chunk(chunk(x, 2), t, text, swapped, 2), ref, atol=1e-5, rtol=1e-5)
        # dropping a history chunk changes the output
        dropped = model.forward_chunk(chunk(x, 2), t, text, cache3.take([0]), 2)
        assert (dropped - ref).abs().max() > 1e-3
        # select rows (a prompt's cache repeated for a group)
        rows = torch.tensor([1, 1, 0])
        picked = model.forward_chunk(chunk(x, 2)[rows], t[rows], text[rows], cache01.select(rows), 2)
        torch.testing.assert_close(picked, ref[rows], atol=1e-5, rtol=1e-5)
        assert cache01.select(rows).batch_size == 3
        # chunk_index must come after every cached chunk
        with pytest.raises(ValueError, match="chunk_index=1 .*cached positions \\[0, 1\\]"):
            model.forward_chunk(chunk(x, 2), t, text, cache01, 1)
        with pytest.raises(ValueError, match="batch 3, x has batch 2"):
            model.forward_chunk(chunk(x, 2), t, text, cache01.select(rows), 2)
    # clone is independent storage, detach cuts the graph
    c = cache01.clone()
    assert c.chunk(0)[0][0].data_ptr() != cache01.chunk(0)[0][0].data_ptr()
    with torch.enable_grad():
        g_cache = KVCache()
        model.forward_chunk(chunk(x, 0), t, text, g_cache, 0, write_cache=True)
    assert g_cache.chunk(0)[0][0].requires_grad and not g_cache.detach().chunk(0)[0][0].requires_grad


def test_shape_guards(model, data):
    x, _, text, t, _ = data
    with pytest.raises(ValueError, match="5 frames.*multiple of chunk_frames=2"):
        model.forward_block_causal(x[:, :, :5], t, text)
    with pytest.raises(ValueError, match="8x7.*divisible by the patch size 2x2"):
        model.forward_block_causal(x[..., :7], t, text)
    with pytest.raises(ValueError, match="text has batch 1, the video has batch 2"):
        model.forward_block_causal(x, t, text[:1])
    with pytest.raises(ValueError, match="4 frames; forward_chunk takes one chunk of chunk_frames=2"):
        model.forward_chunk(x[:, :, :4], t, text, None, 0)
    with pytest.raises(ValueError, match="t must be"):
        model.forward_chunk(chunk(x, 0), torch.rand(B, K), text, None, 0)
    with pytest.raises(ValueError, match="write_cache=True needs a KVCache"):
        model.forward_chunk(chunk(x, 0), t, text, None, 0, write_cache=True)
    max_chunk = model.max_frames // CF  # rope_max_seq_len=32 positions -> chunks 0..15
    with torch.no_grad():
        model.forward_chunk(chunk(x, 0), t, text, None, max_chunk - 1)
    with pytest.raises(ValueError, match="rope_max_seq_len=32"):
        model.forward_chunk(chunk(x, 0), t, text, None, max_chunk)


def test_bfloat16(model, data):
    x, clean, text, t, t_chunks = data
    bf = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        looped, _ = chunk_loop(bf, x, t, text)
        full = bf.forward_block_causal(x, t, text)
        tf = bf.forward_teacher_forced(clean, x, t_chunks, text)
        ref = model.forward_block_causal(x, t, text)
    assert looped.dtype == full.dtype == tf.dtype == torch.bfloat16 and torch.isfinite(tf).all()
    torch.testing.assert_close(looped, full, atol=3e-2, rtol=3e-2)
    assert (full.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_local_window_with_sink_matches_the_routed_cache_loop(model, data):
    # LongLive-style attention: chunk k sees chunk 0 (the sink) and chunk k-1 only. Chunk by chunk
    # with `cache.take(context_chunks(k))` equals the one-pass forms under the same mask.
    windowed = CausalWan(model.transformer, CF, local_window=1, sink_chunks=1)
    g = torch.Generator().manual_seed(3)
    x, clean = torch.randn(B, C, 4 * CF, HW, HW, generator=g), torch.randn(B, C, 4 * CF, HW, HW, generator=g)
    text, t = data[2], torch.rand(B, 4, generator=g)
    assert [windowed.context_chunks(k) for k in range(4)] == [[], [0], [0, 1], [0, 2]]
    with torch.no_grad():
        full, outs, tf_loop = KVCache(), [], []
        for k in range(4):
            ctx = full.take(windowed.context_chunks(k))
            tf_loop.append(windowed.forward_chunk(chunk(x, k), t[:, k], text, ctx, k))
            written = full.take(windowed.context_chunks(k))
            outs.append(windowed.forward_chunk(chunk(clean, k), 0.0, text, written, k, write_cache=True))
            full.append(written.chunk(-1), k, CF)
        block = windowed.forward_block_causal(clean, torch.zeros(B), text)
        teacher = windowed.forward_teacher_forced(clean, x, t, text)
        unwindowed = model.forward_teacher_forced(clean, x, t, text)
    torch.testing.assert_close(torch.cat(outs, 2), block, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(tf_loop, 2), teacher, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk(teacher, 2), chunk(unwindowed, 2), atol=1e-5, rtol=1e-5)  # sees 0, 1 alike
    assert (chunk(teacher, 3) - chunk(unwindowed, 3)).abs().max() > 1e-4  # chunk 3 no longer sees chunk 1
