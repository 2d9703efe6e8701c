"""The step's on-device sampling: counter noise, batched rejection sampling, shaping with per-row
tensors, and one host read per decode step (a counting shim over the calls that sync on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import counter_rng
from engine.batch import ScheduledRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.output_counts import OutputCounts
from engine.request import Request, RequestStatus
from engine.sampler import SamplingRows, probs_device
from engine.speculative import verify_batch
from engine.weights import load_model
from ipc.messages import SamplingParams
from tests.host_syncs import count_host_reads
from tests.sampling_reference import to_probs, verify

TRIALS = 20000


def _python_key(seed: int, counter: int, purpose: int) -> int:
    """The hash as engine/counter_rng.py's docstring states it, in Python integers."""
    def mix(x):
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        return (x >> 16) ^ x
    seed &= 2**64 - 1                                        # int64 bits → the two 32-bit halves
    key = mix(seed & 0xFFFFFFFF)
    key = mix(key ^ (seed >> 32))
    key = mix(key ^ (counter & 0xFFFFFFFF))
    return mix(key ^ ((purpose * 0x9E3779B9) & 0xFFFFFFFF))


def test_the_cpu_hash_kernel_equals_the_torch_ops_bit_for_bit():
    """CPU tensors hash in one numba call (kernels/cpu_sampling.py); the captured GPU path
    runs the torch ops. Both must give the same keys and uniforms, and the stated hash."""
    g = torch.Generator().manual_seed(5)
    seeds = torch.cat((torch.tensor([0, 1, -1, -5, 2**62, 2**63 - 1, -(2**63)]),
                       torch.randint(-(2**62), 2**62, (200,), generator=g)))
    counters = torch.cat((torch.tensor([0, 1, 2**32 - 1, 2**32, 2**40 + 3, 7, 9]),
                          torch.randint(0, 2**40, (200,), generator=g)))
    for purpose in (counter_rng.SAMPLE, counter_rng.ACCEPT, counter_rng.RECOVER, counter_rng.DRAFT):
        keys = counter_rng.row_keys(seeds, counters, purpose)
        assert torch.equal(keys, counter_rng.row_keys_ops(seeds, counters, purpose))
        assert keys.tolist()[:7] == [_python_key(s, c, purpose) for s, c in zip(seeds.tolist()[:7], counters.tolist()[:7])]
    strided = seeds[::3], counters[1::3][: seeds[::3].shape[0]]    # views, not contiguous
    assert torch.equal(counter_rng.row_keys(*strided, 1), counter_rng.row_keys_ops(*strided, 1))
    assert counter_rng.row_keys(seeds[:0], counters[:0], 1).shape == (0,)
    for width in (1, 7, 1000, 4099):
        u = counter_rng.uniform(keys[:5], width)
        assert u.dtype == torch.float32 and torch.equal(u, counter_rng.uniform_ops(keys[:5], width))
        assert torch.equal(counter_rng.exponential(keys[:5], width), -torch.log(counter_rng.uniform_ops(keys[:5], width)))


def test_the_cpu_race_picks_torch_ops_token():
    """counter_rng.race on CPU (numba's fused division and argmax) against the torch ops, over
    peaked, flat, tied, sparse (top-k/top-p zeros) and one-hot rows, and a row with a NaN."""
    g = torch.Generator().manual_seed(3)
    for vocab in (1, 2, 50, 1000, 32000):
        logits = torch.randn(64, vocab, generator=g) * torch.linspace(0.1, 30, 64)[:, None]
        probs = torch.softmax(logits, -1)
        probs[1] = 1.0 / vocab                                     # flat: ties everywhere
        probs[2] = torch.where(probs[2] >= probs[2].median(), probs[2], 0.0)
        probs[3] = 0.0
        probs[3, vocab // 2] = 1.0                                 # one-hot
        probs[4] = 0.0                                             # all zero: the first index
        if vocab > 3:
            probs[5, 3] = float("nan")
        keys = counter_rng.row_keys(torch.arange(64) * 7919 - 5, torch.arange(64) + 11, counter_rng.SAMPLE)
        want = (probs / -torch.log(counter_rng.uniform_ops(keys, vocab))).argmax(-1)
        assert torch.equal(counter_rng.race(probs, keys), want), vocab
        assert torch.equal(counter_rng.race(probs[::2], keys[::2]), want[::2])    # strided rows


def test_counter_noise_is_a_pure_function_of_its_coordinates():
    seeds = torch.tensor([0, 1, -5, 2**62, 7])
    counters = torch.tensor([3, 3, 3, 3, 9])
    a = counter_rng.row_keys(seeds, counters, counter_rng.SAMPLE)
    assert torch.equal(a, counter_rng.row_keys(seeds.clone(), counters.clone(), counter_rng.SAMPLE))
    assert len(set(a.tolist())) == 5  # seeds apart
    assert not torch.equal(a, counter_rng.row_keys(seeds, counters, counter_rng.ACCEPT))  # purposes apart
    assert not torch.equal(a, counter_rng.row_keys(seeds, counters + 1, counter_rng.SAMPLE))  # positions apart
    u = counter_rng.uniform(counter_rng.row_keys(torch.arange(TRIALS), torch.zeros(TRIALS, dtype=torch.long), 1))
    assert ((u > 0) & (u < 1)).all()
    # uniform: the empirical CDF within 5 standard errors at the deciles
    for x in torch.arange(0.1, 1.0, 0.1):
        frac = float((u < x).float().mean())
        assert abs(frac - float(x)) < 5 * (float(x) * (1 - float(x)) / TRIALS) ** 0.5


def _race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return (probs / counter_rng.exponential(keys, probs.shape[-1])).argmax(-1)


def test_batched_rejection_sampling_preserves_the_target_distribution():
    """TRIALS independent requests in one verify_batch call: drafts drawn from q with counter
    noise, verified against p. The first and second emitted tokens are distributed as p (each
    frequency within 5 standard errors, as tests/engine/test_speculative.py does for `verify`)."""
    g = torch.Generator().manual_seed(99)
    vocab, k = 6, 3
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    seeds = torch.arange(TRIALS, dtype=torch.long) * 7919 + 11
    drafts = torch.stack([_race(q.expand(TRIALS, vocab), counter_rng.row_keys(seeds, torch.full_like(seeds, j),
                                                                               counter_rng.DRAFT))
                          for j in range(k)], dim=1)  # [P, k]
    pos = torch.arange(k, dtype=torch.long)[None, :].expand(TRIALS, k).reshape(-1)
    accept_u = counter_rng.uniform(counter_rng.row_keys(seeds.repeat_interleave(k), pos, counter_rng.ACCEPT))
    pos_q = torch.arange(k + 1, dtype=torch.long)[None, :].expand(TRIALS, k + 1).reshape(-1)
    keys = counter_rng.row_keys(seeds.repeat_interleave(k + 1), pos_q, counter_rng.SAMPLE).view(TRIALS, k + 1)
    emitted, accepted = verify_batch(p.expand(TRIALS, k + 1, vocab), drafts, q.expand(TRIALS, k, vocab),
                                     torch.full((TRIALS,), k), accept_u.view(TRIALS, k), keys)
    rows = torch.arange(TRIALS)
    assert (emitted[rows, accepted] >= 0).all() and (accepted <= k).all()
    j = torch.arange(k + 1)[None, :]
    assert ((emitted == torch.cat((drafts, drafts[:, :1]), 1)) | (j >= accepted[:, None])).all()  # prefix = drafts
    assert ((emitted == -1) == (j > accepted[:, None])).all()
    second_rows = accepted >= 1
    for tokens in (emitted[:, 0], emitted[second_rows, 1]):
        freq = torch.bincount(tokens, minlength=vocab).float() / tokens.numel()
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / tokens.numel()).sqrt()).all(), (freq, p)
    rate = float(torch.minimum(p, q).sum())  # P(first draft accepted) = Σ min(p, q)
    assert abs(float(second_rows.float().mean()) - rate) <= 5 * (rate * (1 - rate) / TRIALS) ** 0.5


def test_batched_greedy_verification_equals_verify_with_ragged_drafts():
    """One-hot targets, one-hot drafts, requests with 0..3 drafts padded to 3: the same tokens as
    the per-request `verify`."""
    rng = random.Random(5)
    vocab, d = 7, 3
    cases = []
    for _ in range(40):
        n = rng.randint(0, d)
        argmax = [rng.randrange(vocab) for _ in range(d + 1)]
        drafts = [a if rng.random() < 0.6 else rng.randrange(vocab) for a in argmax[:n]]
        cases.append((argmax, drafts))
    target = torch.zeros(len(cases), d + 1, vocab)
    for i, (argmax, _) in enumerate(cases):
        target[i, torch.arange(d + 1), torch.tensor(argmax)] = 1.0
    padded = torch.tensor([dr + [0] * (d - len(dr)) for _, dr in cases])
    num = torch.tensor([len(dr) for _, dr in cases])
    emitted, accepted = verify_batch(target, padded, None, num, torch.rand(len(cases), d), None)
    for i, (_, drafts) in enumerate(cases):
        want = verify(target[i, : len(drafts) + 1], drafts, None, None)
        assert emitted[i, : int(accepted[i]) + 1].tolist() == want


def test_per_row_distributions_equal_to_probs():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=0.9, top_k=3, top_p=0.5, min_p=0.05), SamplingParams(temperature=1.0)]
    logits = torch.randn(len(params), 50, generator=torch.Generator().manual_seed(3)) * 3
    rows = SamplingRows(params, [0] * len(params), [0] * len(params), "cpu")
    torch.testing.assert_close(probs_device(logits, rows), to_probs(logits, params), atol=1e-6, rtol=1e-5)


def test_penalties_shape_greedy_rows_too():
    """OpenAI presence/frequency penalties apply before the argmax of a greedy row (as in vLLM):
    the one-hot sits on the argmax of the penalized logits, computed here by hand."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(8))
    history = [[int(logits[0].argmax())] * 2, [int(logits[1].argmax()), 5], []]
    params = [SamplingParams(presence_penalty=1.5, frequency_penalty=2.0), SamplingParams(presence_penalty=-2.0),
              SamplingParams(presence_penalty=2.0)]
    rows = SamplingRows(params, [0] * 3, [0] * 3, "cpu")
    counts = OutputCounts(40, "cpu")
    reqs = [Request(i, [1, 2], p) for i, p in enumerate(params)]
    for req, hist in zip(reqs, history):
        req.token_ids += hist  # the output so far
    rows.penalty = (torch.arange(3), counts.rows(counts.slots(reqs)))
    probs = probs_device(logits, rows)
    want = logits.clone()
    for i, (p, hist) in enumerate(zip(params, history)):
        counts = torch.bincount(torch.tensor(hist, dtype=torch.long), minlength=40).float()
        want[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    assert probs.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert int(probs[0].argmax()) != int(logits[0].argmax())  # the penalty moved the choice
    assert torch.equal(probs.sum(-1), torch.ones(3)) and int((probs > 0).sum()) == 3  # one-hot rows


def test_output_counts_follow_emitted_tokens_and_reuse_finished_rows():
    """A row starts as the request's output counts, gains each emitted token (−1: none), and
    a finished request's row goes to the next request, cleared; rows grow past the first four."""
    counts = OutputCounts(10, "cpu")
    reqs = [Request(i, [9], SamplingParams(presence_penalty=1.0)) for i in range(6)]
    reqs[0].token_ids += [3, 3, 7]
    slots = counts.slots(reqs[:2])
    assert counts.rows(slots)[0].tolist() == [0, 0, 0, 2, 0, 0, 0, 1, 0, 0] and counts.rows(slots)[1].sum() == 0
    counts.add(slots, torch.tensor([[4, 4, -1], [0, -1, -1]]))
    assert counts.rows(slots).tolist() == [[0, 0, 0, 2, 2, 0, 0, 1, 0, 0], [1] + [0] * 9]
    assert torch.equal(counts.slots(reqs[:2]), slots)  # the same rows while the requests live
    reqs[0].status = RequestStatus.FINISHED
    later = counts.slots(reqs[2:])  # four more: one takes request 0's row, the rest grow the matrix
    assert int(slots[0]) in later.tolist() and counts.rows(later).sum() == 0 and counts.num_live == 5
    assert counts.rows(counts.slots([reqs[1]])).tolist() == [[1] + [0] * 9]


def test_a_verify_row_penalizes_the_drafts_before_it():
    """Greedy verification under a frequency penalty: row j's history is the output plus drafts
    1..j−1. Token 5 leads every row by a little, so a row that counts draft 5 picks 6, and one
    that counts 5 and 6 picks 7: drafts [5, 6, 7] are all accepted only if each row counts the
    drafts before it, and the bonus token then avoids all three."""
    from engine.model_runner import _Pending
    from engine.step_sampling import StepSampler

    vocab = 12
    logits = torch.zeros(4, vocab)
    logits[:, 5], logits[:, 6], logits[:, 7], logits[:, 8] = 5.0, 4.9, 4.8, 4.7
    req = Request(0, [1, 2, 3], SamplingParams(frequency_penalty=1.0))
    req.token_ids += [9]  # one output token so far, penalized too
    req.draft_token_ids = [5, 6, 7]
    sched = ScheduledRequest(req, 3, 4, 3, True)  # positions 3..6: the last token and three drafts
    sample = StepSampler(torch.device("cpu")).sample([_Pending(sched, slice(0, 4))], logits)
    assert sample.num_accepted.tolist() == [3] and sample.emitted.tolist() == [[5, 6, 7, 8]]


def _openai_penalties(presence: float, frequency: float, prompt_len: int):
    """transformers logits processor: OpenAI's presence/frequency penalties over the generated
    tokens (the reference for the engine's device counts)."""
    def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for b in range(input_ids.shape[0]):
            counts = torch.bincount(input_ids[b, prompt_len:], minlength=scores.shape[-1]).float()
            out[b] -= frequency * counts + presence * (counts > 0).float()
        return out

    return process


@pytest.mark.parametrize("spec,async_scheduling", [(0, False), (3, False), (3, True)],
                         ids=["plain", "mtp", "mtp-async"])
def test_penalized_greedy_tokens_match_transformers(checkpoint_factory, spec, async_scheduling):
    """Greedy decoding under presence and frequency penalties equals transformers' generate with
    the penalties applied by a hand-written logits processor, through MTP verification (drafts
    penalized as the target penalizes) and async scheduling (the counts never visit the host)."""
    transformers = pytest.importorskip("transformers")
    from transformers import LogitsProcessorList

    path = checkpoint_factory("tiny-upstream", layout="upstream", index_topk=64)
    ours = load_model(path, dtype=torch.float32, progress=False)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [torch.randint(2, ours.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 19)]
    params = [SamplingParams(max_tokens=24, presence_penalty=0.8, frequency_penalty=0.6, ignore_eos=True),
              SamplingParams(max_tokens=20, frequency_penalty=1.5, ignore_eos=True)]
    want = []
    with torch.no_grad():
        for ids, p in zip(prompts, params):
            processor = _openai_penalties(p.presence_penalty, p.frequency_penalty, len(ids))
            out = ref.generate(torch.tensor([ids]), max_new_tokens=p.max_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, logits_processor=LogitsProcessorList([processor]))
            want.append(out[0, len(ids):].tolist())
    engine = Engine(ours, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20,
                                       block_size=16, cpu_matmul_precision="fp32", speculative_tokens=spec,
                                       adaptive_speculation=False, async_scheduling=async_scheduling))
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(i, ids, p)
    got = {0: [], 1: []}
    while engine.has_work:
        for d in engine.step().deltas:
            got[d.request_id] += d.token_ids
    assert [got[0], got[1]] == want
    assert len(set(want[0])) > 12  # the penalties broke the random model's loops
    assert engine.runner.sampler.output_counts.num_live == 0 or all(
        r.is_finished for r, _ in engine.runner.sampler.output_counts._slot.values())


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("tiny-topk2", index_topk=2), dtype=torch.float32, progress=False)


@pytest.mark.parametrize("spec", [0, 2])
def test_one_host_read_per_static_decode_step(model, spec):
    """Uniform decode steps on the static backend (speculation with MTP drafts included, sampled
    and greedy requests side by side): exactly one syncing call per step, the runner's read."""
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20,
                                        block_size=16, static_decode=True, cuda_graph_sizes=(1, 2, 4),
                                        speculative_tokens=spec, adaptive_speculation=False))
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=4)]
    for i, p in enumerate(params):
        engine.add_request(i, [5 + i, 9, 17, 33], p)
    runner, steps = engine.runner, []
    execute = runner.execute

    def counted(batch, *args, **kwargs):  # the runner's part of a step: forwards, sampling, drafts
        static = runner.static_ok(batch)
        with count_host_reads() as calls:
            out = execute(batch, *args, **kwargs)
        steps.append((static, list(calls)))
        return out

    runner.execute = counted
    while engine.has_work:
        engine.step()
    decode = [calls for static, calls in steps if static]
    assert len(decode) >= 3 and len(steps) > len(decode)  # the prefill step ran per-sequence
    assert all(len(calls) == 1 for calls in decode), decode  # the one read back
    assert not spec or engine.stats.spec_draft_tokens > 0  # verify steps with MTP drafts were among them


@pytest.mark.parametrize("vocab", [300, 1000, 4133])
def test_the_cpu_greedy_pass_equals_argmax_and_isfinite(vocab):
    """kernels/cpu_sampling.greedy_rows and its parallel twin (a greedy step's pass per row on CPU:
    vector blocks of 256 for a finite row) against torch's argmax (first maximum, first NaN) and isfinite over
    ties within and across blocks, signed zeros, a maximum in the tail, infinities and NaNs."""
    from kernels import cpu_sampling

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(16, vocab, generator=g)
    logits[1] = 0.5                                            # all tied: index 0
    logits[2, 7] = logits[2, 200] = 99.0                       # tied maximum: the first
    logits[3, 5] = float("inf")
    logits[4, 10], logits[4, 0] = float("-inf"), float("-inf")
    logits[5, 17], logits[5, 40] = float("nan"), 1e9            # a NaN before the maximum wins
    logits[6, 0] = float("nan")
    logits[7] = float("-inf")
    logits[8, vocab - 1] = float("nan")
    logits[9, vocab - 1] = 50.0                                # the maximum in the last elements
    logits[10] = -logits[10].abs() - 1                         # -0.0 then 0.0 (maybe blocks apart): the -0.0
    logits[10, 3], logits[10, vocab - 2] = -0.0, 0.0
    logits[12, 299], logits[12, vocab - 3] = 7.0, 7.0          # a tie whose second half may sit blocks later
    logits[13, 255], logits[13, 256 % vocab] = 8.0, 8.0         # a tie across a block's edge
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 2, 15, 14])  # any order, repeats
    for greedy in (cpu_sampling.greedy_rows, cpu_sampling.greedy_rows_parallel):
        token, finite = torch.empty(len(rows), dtype=torch.int64), torch.empty(len(rows), dtype=torch.bool)
        greedy(logits.numpy(), rows.numpy(), token.numpy(), finite.numpy())
        assert torch.equal(token, logits[rows].argmax(-1))
        assert torch.equal(finite, torch.isfinite(logits[rows]).all(-1))
