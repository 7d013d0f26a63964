"""Say whether an out-of-memory error came from fragmentation or capacity, and what to do next.

:mod:`.classifier` is pure (memory stats in, :class:`Diagnosis` out; ``mbx diagnose``);
:mod:`.handler` runs in the training process and writes the report at the OOM.
"""

from megatron_bridge_ext.diagnose.classifier import (
    DECISION_ORDER,
    Diagnosis,
    classify,
    diagnose_file,
    fmt_bytes,
    parse_oom_message,
)
from megatron_bridge_ext.diagnose.handler import REPORT_DIR_ENV, REPORT_FORMAT, OOMHandler, oom_guard

__all__ = [
    "DECISION_ORDER", "Diagnosis", "OOMHandler", "REPORT_DIR_ENV", "REPORT_FORMAT", "classify", "diagnose_file",
    "fmt_bytes", "oom_guard", "parse_oom_message",
]
