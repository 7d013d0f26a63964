"""``mbx patches``: every change the extension can make to upstream, and whether this environment needs it."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict

STATUS_WORDS = {
    "applied": "applied in this process",
    "not applied": "needed here (applied when its feature runs)",
    "not needed": "not needed here",
    "out of range": "out of range (nothing applied)",
    "refused": "refused: upstream code changed (--verbose says what)",
}


def command(args) -> int:
    from megatron_bridge_ext import logs
    from megatron_bridge_ext.patches import apply_all, bridge_peft_without_te, registry, status_all
    from megatron_bridge_ext.table import text_table

    logs.configure()
    # The plan's import hooks are needed while Bridge is not imported yet: judge (or apply) them before this
    # command imports it, or each would read "not needed" because of the report itself.
    before = {s.name: s for s in (registry.apply_plan_imports() if args.apply else status_all(registry.PLAN_IMPORTS))}
    # Inspect Bridge's PEFT modules the way megatron_bridge_ext.peft.LoRA imports them.
    bridge_peft_without_te.import_bridge_peft()
    statuses = [before.get(s.name, s) for s in (apply_all() if args.apply else status_all())]
    if args.json:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
        return 0
    rows = [[s.name, s.versions, STATUS_WORDS.get(s.status, s.status)] for s in statuses]
    print(text_table(["patch", "applies to", "status"], rows))
    if args.verbose:
        for s in statuses:
            print(f"\n{s.name}")
            for label, text in (("target", s.target), ("why", s.reason), ("applied by", s.applied_by)):
                print(textwrap.fill(text, width=100, initial_indent=f"  {label + ':':12}",
                                    subsequent_indent=" " * 14))
    applied = [s.name for s in statuses if s.status == "applied"]
    print("\nthis process: " + (f"{len(applied)} applied ({'--apply' if args.apply else 'already'})" if applied
                                else "nothing applied; each feature applies the patches it needs when it runs")
          + ("" if args.verbose else "; --verbose shows each patch's target, reason and when it is applied"))
    return 0
