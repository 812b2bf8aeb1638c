"""The runtime's logger: ``logging.getLogger("lowcomm_kernels")`` with the rank in every record.

Runtime events (a skipped sync, a rank restarted after non-finite values) are logged, not warned:
``warnings`` is kept for misuse by the caller. Applications choose where records go with the
standard ``logging`` configuration; each record carries ``rank`` (group rank) as an attribute and
in its message prefix, so the lines of several ranks can be told apart in one stream. No handler is
attached here: until the application configures logging, Python's last-resort handler prints
warnings (a skipped sync, a restart) to stderr, so they are never silent.
"""

from __future__ import annotations

import logging

LOGGER = logging.getLogger("lowcomm_kernels")


class RankLogger(logging.LoggerAdapter):
    """Prefixes each message with ``[rank R]`` and adds ``rank`` to the record."""

    def process(self, msg, kwargs):
        rank = self.extra["rank"] if self.extra else -1
        kwargs.setdefault("extra", {})["rank"] = rank
        return f"[rank {rank}] {msg}", kwargs


def rank_logger(rank: int) -> RankLogger:
    return RankLogger(LOGGER, {"rank": rank})
