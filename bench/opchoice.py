"""The op-choice table this host produces for a SmolLM2-135M-shaped model.

    python bench/opchoice.py                      # bf16 and fp32, batch 1 and 8
    python bench/opchoice.py --dtype bfloat16 --batch 8 --rounds 3

For each (dtype, batch) the spec bench/peers.py compiles (a 64-token context bucket, one
token-generation bucket) is handed to the chooser a build uses (opchoice.choose on the
backend's target: this CPU's flags and half units), measuring whatever NEURONCTL_OP_CHOICE
says; nothing is compiled and no checkpoint is read. Prints, per row count, the path chosen
and each candidate's milliseconds for one step's projections. `--rounds` repeats the choice
to show whether it is stable on this host. The candidates are `path/layout/dtype`, the
dtype the graph computes in (float32, or bf16 where the CPU has bf16 units).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from decode import NEW, PROMPT, SHAPE  # noqa: E402


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name")), platform.processor())
    except OSError:
        return platform.processor()


def table(dtype: str, batch: int) -> str:
    from neuronctl.backends.torch import opchoice
    from neuronctl.backends.torch.config import args_from_config
    from neuronctl.spec import ModelShape, finalize, resolve_spec

    spec = {"model": "smollm2-135m-shape", "compiler": "inductor", "dtype": dtype,
            "batch_size": batch, "seq_len": PROMPT + NEW, "max_context_length": PROMPT,
            "context_buckets": str(PROMPT), "token_gen_buckets": str(PROMPT + NEW)}
    finalized = finalize(resolve_spec(spec, None, {})[0], ModelShape.from_config(SHAPE))
    target = opchoice.spec_inputs(finalized, args_from_config(SHAPE))
    choice = opchoice.choose(target)
    computes = "/".join(str(c).removeprefix("torch.") for c in target.computes)
    lines = [f"{dtype} batch {batch}: computes {computes}, layout {choice.layout}, chosen by "
             f"{choice.chosen_by}; a request = the prompt once + {opchoice.GENERATED} steps"]
    for row in choice.rows:
        ms = ", ".join(f"{path} {value:.2f}" for path, value in row.ms.items())
        timed = f" (timed at {row.timed_rows})" if row.timed_rows not in (None, row.rows) else ""
        lines.append(f"  {row.rows:>4} rows{timed}: {row.path:<7} {row.compute:<8} "
                     f"ms: {ms or '-'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", action="append", type=int)
    parser.add_argument("--rounds", type=int, default=1)
    opts = parser.parse_args()
    print(f"host: {cpu_model()}")
    for dtype in opts.dtype or ["bfloat16", "float32"]:
        for batch in opts.batch or [1, 8]:
            for _ in range(opts.rounds):
                print(table(dtype, batch), flush=True)


if __name__ == "__main__":
    main()
