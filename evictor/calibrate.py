"""Write the per-model calibration file a policy needs: ``python -m evictor.calibrate METHOD --traces T --out FILE``.

    python -m evictor.calibrate triattention --model qwen3-4b --traces dense/generations.jsonl --out tri.json
    python -m evictor.calibrate thinkv --traces dense/generations.jsonl --out thinkv.json --tau 128

Methods: ``triattention`` (query centres and RoPE frequencies, `evictor.calibration.triattention`) and ``thinkv``
(attention-sparsity thresholds from `attn.hook_pattern`, `evictor.calibration.thinkv`). The traces
are dense trace records (``tasks.run`` or ``evictor.run --policy full``), each run through the model once,
teacher-forced. The file is written only when the calibration succeeds; the resolved configuration is saved beside
it as ``<stem>.config.json``. Pass the file to the policy as ``calibration`` (``evictor.run --policy-config``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.cli import (
    ArgumentParser,
    add_device_arguments,
    check_output_file,
    main_guard,
    positive_int,
    save_config,
    write_json,
)
from core.limits import Footprint, MemoryLimit
from evictor.calibration import dense_traces
from evictor.calibration.thinkv import DEFAULT_BAND_ORDER, DEFAULT_TAU, check_band_order
from signals.traces import traces_model

METHODS = ("triattention", "thinkv")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m evictor.calibrate",
                            description="Compute a policy's per-model calibration from a few dense traces and write it "
                            "as one JSON file that the policy loads (its `calibration` parameter).")
    methods = parser.add_subparsers(dest="method", required=True, metavar="METHOD",
                                    help=f"what to calibrate: {', '.join(METHODS)}")
    common = ArgumentParser(add_help=False)
    common.add_argument("--traces", required=True,
                        help="dense trace records (JSONL of tasks.run or evictor.run --policy full)")
    common.add_argument("--out", required=True, help="calibration file to write (JSON)")
    common.add_argument("--model", default=None,
                        help="model to calibrate (registry name, HF directory, .gguf or hub id); default: the "
                        "traces' model")
    common.add_argument("--limit", type=positive_int, default=None, help="only the first N traces")
    common.add_argument("--max-tokens", type=positive_int, default=None,
                        help="cut each trace (prompt + generation) to its first N tokens (default: whole traces)")
    add_device_arguments(common)
    methods.add_parser("triattention", parents=[common],
                       help="TriAttention: per query head, the mean pre-RoPE query and mean pair length; RoPE "
                       "frequencies per layer")
    thinkv = methods.add_parser("thinkv", parents=[common],
                                help="ThinKV: per layer, the attention-sparsity thresholds of the R / E / T thoughts")
    thinkv.add_argument("--tau", type=positive_int, default=DEFAULT_TAU,
                        help=f"refresh window: tokens per classified block (default {DEFAULT_TAU}); the policy's "
                        "tau must match")
    thinkv.add_argument("--band-order", default=",".join(DEFAULT_BAND_ORDER),
                        help="thought types of the low, middle and high sparsity band, a permutation of R,E,T "
                        f"(default {','.join(DEFAULT_BAND_ORDER)})")
    return parser


def check_calibration_memory(model: str, traces: list, args: argparse.Namespace) -> None:
    """Refuse a calibration that would need more memory than the device has or --max-memory allows: one forward
    over the longest trace read (at most --max-tokens) and, for ThinKV's attention sparsity, one layer's attention
    maps at a time (logits, probabilities and the sparsity ranks, fp32)."""
    from models.footprint import FP32, forward_footprint, model_shape

    shape = model_shape(model, args.dtype, args.device)
    tokens = max(len(trace.token_ids) for trace in traces)
    if args.max_tokens is not None:
        tokens = min(tokens, args.max_tokens)
    maps = 3 * shape.q_heads * tokens * tokens * FP32 if args.method == "thinkv" else 0
    (forward_footprint(shape, 1, tokens) + Footprint((("attention maps", maps),))).check(
        f"{model} calibrating {args.method} on traces of up to {tokens} tokens",
        MemoryLimit.of(args.device, args.max_memory), "lower --max-tokens")


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).expanduser()
    check_output_file(out)
    band_order = check_band_order(args.band_order.split(",")) if args.method == "thinkv" else None
    traces = dense_traces(args.traces, args.limit)
    model_name = traces_model(traces, args.model, f"--traces {args.traces}")
    check_calibration_memory(model_name, traces, args)

    from tqdm import tqdm

    from models.loading import load_model

    lm = load_model(model_name, device=args.device, dtype=args.dtype)
    progress = lambda items: tqdm(items, desc=f"calibrate {args.method}", unit="trace", file=sys.stderr)
    if args.method == "triattention":
        from evictor.calibration.triattention import calibrate_triattention

        record = calibrate_triattention(lm, traces, max_tokens=args.max_tokens, progress=progress)
    else:
        from evictor.calibration.thinkv import calibrate_thinkv

        assert band_order is not None  # read above for thinkv, the only other method
        record = calibrate_thinkv(lm, traces, tau=args.tau, band_order=band_order, max_tokens=args.max_tokens,
                                  progress=progress)
    record["source"] = {"traces": str(Path(args.traces).resolve()), "loaded_model": lm.describe()}
    write_json(out, record)
    save_config(out.parent, {"method": args.method, "traces": str(Path(args.traces).resolve()), "model": model_name,
                             "limit": args.limit, "max_tokens": args.max_tokens, "device": args.device,
                             "dtype": args.dtype, "tau": getattr(args, "tau", None),
                             "band_order": None if band_order is None else list(band_order),
                             "loaded_model": lm.describe()},
                name=f"{out.stem}.config.json")
    print(f"{args.method} calibration of {model_name} from {len(traces)} traces ({record['tokens']} tokens) -> {out}")
    return 0


main = main_guard(_run)

if __name__ == "__main__":
    raise SystemExit(main())
