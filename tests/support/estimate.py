"""What the estimate tests share: the public model shape they read and the layout of its LoRA estimate."""

from __future__ import annotations

import os

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
QWEN3_8B = os.path.join(DATA, "qwen3-8b", "config.json")
TP, SEQ, DP, RANK = 2, 8192, 4, 16
