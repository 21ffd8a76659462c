"""The vLLM side of `tasks.engines.VLLMEngine`: run as a script by an interpreter that has vLLM, talking JSON lines.

It imports nothing from kvscope, so it runs in vLLM's own environment (whose transformers release kvscope cannot
use, docs/engines.md). Protocol, one JSON object per line:

1. parent -> worker: ``{"model": dir, "dtype": ..., "seed": ..., "max_num_seqs": ..., "max_model_len": ...,
   "enforce_eager": ...}``; worker -> parent: ``{"ready": true, "version": ..., "device": ..., "dtype": ...}``.
2. parent -> worker, any number of times: ``{"requests": [{"prompt_ids", "max_new_tokens", "temperature", "top_p",
   "seed"}, ...], "stop_ids": [...], "max_in_flight": n}``; worker -> parent: ``{"index", "generated_ids",
   "finish_reason", "prefill_s", "decode_s"}`` for each request as it finishes, then ``{"done": true}``.
3. End of input (the parent closed the pipe or died): the worker shuts vLLM's engine processes down and exits. A
   failure is one ``{"error": "..."}`` line, then exit status 1.

At most ``max_in_flight`` requests are in the engine at a time, the next added as one finishes (vLLM schedules up
to ``max_num_seqs`` of them per step, with automatic prefix caching), so a job's concurrency can be lower than the
engine's without a restart. Each stops exactly at ``stop_ids`` (vLLM's own EOS rule is off), the stop token kept.
``prefill_s`` is the time from the request's addition to its first token (queueing in vLLM included), ``decode_s``
from there to its last.
"""

from __future__ import annotations

import json
import os
import sys
import time

# On the CPU, vLLM reserves a fraction of the NUMA node's memory (0.92 by default) and refuses to start when other
# processes hold more than the rest, as on a shared machine; a KV cache of fixed size (vLLM's own CPU setting, in GiB;
# a user's value is kept) starts whatever else runs. 4 GiB holds 32 sequences of 2,048 tokens of Qwen2.5-1.5B in fp32.
CPU_KV_CACHE_GIB = "4"


def _serve(lines, send) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    setup = json.loads(next(lines))
    llm = LLM(model=setup["model"], tokenizer=setup["model"], dtype=setup["dtype"], seed=setup["seed"],
              max_num_seqs=setup["max_num_seqs"], max_model_len=setup.get("max_model_len"),
              enable_prefix_caching=True, enforce_eager=setup["enforce_eager"])
    send({"ready": True, "version": vllm.__version__, "device": current_platform.device_type,
          "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")})
    try:
        for line in lines:
            _run_job(llm.llm_engine, json.loads(line), send)
            send({"done": True})
    finally:  # stop vLLM's engine processes now: left to interpreter exit, their shutdown can wait forever
        llm.llm_engine.engine_core.shutdown()


def _run_job(engine, job: dict, send) -> None:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    stops = sorted(set(job["stop_ids"]))
    waiting = iter(enumerate(job["requests"]))
    tokens: dict[str, list[int]] = {}
    added: dict[str, float] = {}
    first: dict[str, float] = {}

    def add_next() -> None:
        index, request = next(waiting, (None, None))
        if request is None:
            return
        params = SamplingParams(max_tokens=request["max_new_tokens"], temperature=request["temperature"],
                                top_p=request["top_p"], seed=request["seed"], stop_token_ids=stops, ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=request["prompt_ids"]), params)
        tokens[str(index)], added[str(index)] = [], time.perf_counter()

    for _ in range(job["max_in_flight"]):
        add_next()
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            new = list(output.outputs[0].token_ids) if output.outputs else []
            if new and output.request_id not in first:
                first[output.request_id] = now
            tokens[output.request_id] += new
            if output.finished:
                out = tokens.pop(output.request_id)
                began = first.pop(output.request_id, now)
                send({"index": int(output.request_id), "generated_ids": out,
                      "finish_reason": "eos" if out and out[-1] in stops else "length",
                      "prefill_s": began - added.pop(output.request_id), "decode_s": now - began})
                add_next()


def main() -> int:
    # The protocol owns the real stdout; everything else written to file descriptor 1 (vLLM's logs, its engine
    # processes, which inherit it) goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        _serve(iter(sys.stdin.readline, ""), send)
    except Exception as err:  # reported to the parent as one line; the traceback stays on stderr
        import traceback

        traceback.print_exc()
        send({"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})
        return 1
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this file: the guard keeps it idle
    raise SystemExit(main())
