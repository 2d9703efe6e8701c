"""One rank of the expert-parallel dry run (tests/gpu_dry_run/test_dry_run_ep.py), in its own
process: a real gloo group, then the model on the fake CUDA device with this rank's share of the
experts, an engine stepping in lockstep with the other rank, its decode steps captured.

Writes `<out>/rank<r>.json`: per step (host reads, waits, graph replays, collectives in capture),
the captures, and any fault or error as text.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path


def main(rank: int, port: int, model_dir: str, backend: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    from engine.config import EngineConfig, ModelConfig, ParallelConfig
    from engine.distributed.expert_parallel import ExpertParallel, experts_to_load, initial_placement
    from engine.distributed.group import init_group
    from engine.distributed.lockstep import Lockstep, StepPlan
    from engine.engine import Engine
    from engine.weights import load_model
    from ipc.messages import SamplingParams
    from tests.fake_cuda import fake_cuda

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    result: dict = {"steps": []}
    group = init_group(rank, 2, "127.0.0.1", port, "gloo", "dry-run", 60.0, local_rank=0)
    try:
        with fake_cuda() as record, torch.inference_mode():
            parallel = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, all2all_backend=backend)
            config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=16, num_kv_blocks=16,
                                  cuda_graph_sizes=(1, 2), max_model_len=64, enable_prefix_caching=False,
                                  speculative_tokens=0)
            cfg = ModelConfig.from_model_dir(model_dir)
            placement = initial_placement(cfg, 0, parallel)
            model = load_model(model_dir, dtype=torch.bfloat16, device="cuda", progress=False, load_mtp=False,
                               experts=experts_to_load(placement, rank))
            ExpertParallel(model, group, parallel, placement, config.max_num_batched_tokens)
            engine = Engine(model, config)
            result["captures"] = record.captures
            lockstep = Lockstep(group, None, parallel)
            # rank 0 serves two requests, rank 1 one that ends sooner: it then runs dummy steps
            prompts = [[5, 9, 17, 33, 40, 41], [7, 8, 9]] if rank == 0 else [[11, 12, 13, 14]]
            for i, prompt in enumerate(prompts):
                engine.add_request(i, prompt, SamplingParams(max_tokens=6 if rank == 0 else 3, ignore_eos=True))
            while True:
                batch = engine.scheduler.schedule()
                wish = StepPlan(bool(batch), 0, engine.runner.static_ok(batch), not engine.has_work)
                plan = lockstep.agree(wish)
                if plan.stopping and not plan.has_work:
                    break
                mark, replays, calls = record.mark(), record.replays, len(record.collectives)
                engine.run(batch, plan.num_drafts, allow_static=plan.static_ok, lockstep=True)
                result["steps"].append({"static": plan.static_ok, "reads": len(record.since(mark, "d2h")),
                                        "syncs": len(record.syncs(mark)), "replays": record.replays - replays,
                                        "collectives": len(record.collectives) - calls})
            result["captured_collectives"] = sum(1 for c in record.collectives if c[3])
    except BaseException as exc:  # noqa: BLE001 - reported to the test process
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        group.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
