"""How ``mbx run`` gives the launched Python processes what ``megatron_bridge_ext.init()`` installs.

``mbx run`` replaces itself with the command (``torchrun ...``), so nothing of ours runs in the
training processes unless Python itself starts it. Python imports the first ``sitecustomize``
module on ``sys.path`` at start-up, before the script, in every interpreter the command starts
(torchrun's workers included); ``PYTHONPATH`` entries come before site-packages. So ``mbx run``
puts this folder first on ``PYTHONPATH`` and sets ``MBX_RUN_INIT=1``; the ``sitecustomize.py``
here installs the import hooks and then runs the ``sitecustomize`` Python would otherwise have run.
A ``.pth`` file would need write access to site-packages and would act in every process of that
environment, launched by ``mbx run`` or not; this acts only where ``mbx run`` set the variable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

FOLDER = str(Path(__file__).resolve().parent)
VARIABLE = "MBX_RUN_INIT"


def prepare_environment(env: MutableMapping[str, str]) -> str:
    """Put this folder first on ``env``'s PYTHONPATH (the user's entries kept after it) and set MBX_RUN_INIT=1.

    A user's ``MBX_RUN_INIT`` other than 1 turns this off and is kept. Returns the line that says what changed.
    """
    if (env.get(VARIABLE) or "1") != "1":
        return (f"{VARIABLE}={env[VARIABLE]!r}: PYTHONPATH left as it is, so the training processes get no "
                "megatron_bridge_ext.init() hooks (unset it to have them)")
    old = env.get("PYTHONPATH")
    env[VARIABLE] = "1"
    if old is not None and FOLDER in old.split(os.pathsep):
        return f"PYTHONPATH already holds {FOLDER}; {VARIABLE}=1"
    env["PYTHONPATH"] = FOLDER if not old else FOLDER + os.pathsep + old
    return (f"PYTHONPATH: {FOLDER} put first ({'your entries kept after it' if old else 'it was unset'}) and "
            f"{VARIABLE}=1: its sitecustomize installs megatron_bridge_ext.init()'s import hooks (Bridge's training "
            "entry points, the TE LoRA norm-gradient fix and check) in each Python process of the command, then "
            "runs any other sitecustomize on the path")
