"""`rl2run`: torchrun that adds nothing to what rl2 already said.

    rl2run --nproc_per_node=2 -m rl2.trainer.ppo key=value ...

It takes torchrun's arguments and runs torchrun's own launcher in this process. rl2's commands end a
run on a mistake the user can fix with one `rl2: error: ...` line and exit code 2, and on Ctrl-C with
one line saying where to resume and exit code 130 (`rl2.trainer.base.run_main`). Plain torchrun
follows either with its failure report (a traceback and a summary, ~40 lines); `rl2run` exits with
the rank's code and prints nothing more. Any other failure gets torchrun's report in full, with the
launcher's log lines that came before it.
"""

import logging
import os
import sys

# The exit codes of a run that rl2 ended with its own one-line explanation (rl2.trainer.base.run_main).
USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130
EXPLAINED_EXIT_CODES = (USER_ERROR_EXIT, INTERRUPTED_EXIT)


class _HeldRecords(logging.Handler):
    """Keeps the launcher's log records until it is known whether they are needed."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    if str(args.nproc_per_node) != "1":
        # torchrun sets 1 as well, with a four-line warning each run.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch gives its distributed loggers handlers of their own: hold their records instead.
    held = _HeldRecords()
    replaced = {logger: logger.handlers for name, logger in logging.root.manager.loggerDict.items()
                if name.startswith("torch.distributed") and isinstance(logger, logging.Logger) and logger.handlers}
    for logger in replaced:
        logger.handlers = [held]

    def replay_held_logs() -> None:
        for logger, handlers in replaced.items():
            logger.handlers = handlers
        for record in held.records:
            logging.getLogger(record.name).handle(record)

    try:
        torchrun.run(args)
    except ChildFailedError as failure:
        _, first = failure.get_first_failure()
        if first.exitcode in EXPLAINED_EXIT_CODES:
            sys.exit(first.exitcode)
        replay_held_logs()
        raise
    except SignalException as stop:  # Ctrl-C or a kill reached the launcher; the ranks have their own line
        sys.exit(128 + int(stop.sigval))
    except BaseException:
        replay_held_logs()
        raise


if __name__ == "__main__":
    main()
