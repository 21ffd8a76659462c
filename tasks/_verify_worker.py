"""Child process behind `tasks.grading.MathVerifier`: math-verify equivalence, one JSON request per stdin line.

Kept to the standard library plus math-verify, and run as a plain script, so it starts without importing torch or
kvscope. math-verify's own timeouts use SIGALRM; they are switched off here because the parent enforces the time
limit by killing this process, which also works when the caller is not on the main thread.
"""

import json
import logging
import sys


def main() -> None:
    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    from math_verify import parse, verify

    for line in sys.stdin:
        request = json.loads(line)
        try:
            gold = parse(request["gold"], parsing_timeout=None)
            pred = parse(request["pred"], parsing_timeout=None)
            reply: dict[str, bool | str] = {"equal": bool(gold and pred and verify(gold, pred, timeout_seconds=None))}
        except Exception as err:  # a parse failure is an answer ("cannot tell"), not a crash
            reply = {"error": f"{type(err).__name__}: {err}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
