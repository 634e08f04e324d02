"""Where a whole model's prefill and decode step go (run by hand on a GPU; no pytest):
``python benchmarks/profile_model_inference.py``.

The model of ``nats bench model`` (12 layers, width 768, bf16) as the transformer, the
all-linear model and NAtS-L at forced softmax fractions 0 and 0.25. For each: prefill
(``model.prefill``, the cache built) and the plain no-gradient forward at 4k and 32k
tokens, batch 1, as wall time (GPU caught up) and host time (the call's return, the GPU
idle before it: equal to the wall time where the host bounds the call); for NAtS-L at
0.25 and 4k a ``cProfile`` of the prefill; for every form and length the prefill's CUDA
kernels (``torch.profiler``, by GPU time), and the kernels of one eager decode step after
a 1k-token prompt (count, GPU time, names), which is what a graphed decode step replays.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch

from nats.evaluation.model_bench import (
    ModelBenchConfig,
    Variant,
    _autocast,
    variant_model,
    variants,
)
from nats.model import NatsForCausalLM

FORMS = ("transformer", "all-linear", "nats@0", "nats@0.25")
LENGTHS = (4096, 32_768)


def wall_ms(fn: Callable[[], object], n: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def host_ms(fn: Callable[[], object], n: int = 5) -> float:
    total = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / n * 1e3


def print_host_profile(fn: Callable[[], object]) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(35)
        print(text.getvalue(), flush=True)


def print_kernels(fn: Callable[[], object], rows: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows), flush=True)


def decode_kernels(model: NatsForCausalLM, vocab: int, device: torch.device) -> None:
    ids = torch.randint(0, vocab, (1, 1024), device=device)
    _, cache = model.prefill(ids)
    token = ids[:, -1]
    for _ in range(3):
        model.decode_compute(token, cache)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.decode_compute(token, cache)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"  decode step: {len(events)} kernels, "
          f"{sum(e.device_time for e in events):.0f} us of kernel time", flush=True)
    print("   ", Counter(e.name[:60] for e in events).most_common(40), flush=True)


def profile_form(variant: Variant, config: ModelBenchConfig, device: torch.device) -> None:
    model = variant_model(variant, config, device).to(torch.bfloat16).eval()
    with torch.no_grad(), _autocast(device):
        for length in LENGTHS:
            ids = torch.randint(0, config.vocab_size, (1, length), device=device)
            for name, fn in (("prefill", partial(model.prefill, ids)),
                             ("forward", partial(model, ids))):
                print(f"{variant.name} T={length} {name}: wall {wall_ms(fn):.2f} ms, "
                      f"host {host_ms(fn):.2f} ms", flush=True)
                if name == "prefill":
                    if variant.name == "nats@0.25" and length == LENGTHS[0]:
                        print_host_profile(fn)
                    print_kernels(fn, 30 if variant.name == "nats@0.25" else 15)
        print(variant.name, flush=True)
        decode_kernels(model, config.vocab_size, device)


def main() -> None:
    config = ModelBenchConfig()
    device = torch.device("cuda")
    for variant in variants(config):
        if variant.name in FORMS:
            profile_form(variant, config, device)
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
