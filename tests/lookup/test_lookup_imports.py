"""The lookup core stays pure Python: importing it must not import torch."""

from __future__ import annotations

import subprocess
import sys

import metrale.lookup


def test_importing_metrale_lookup_does_not_import_torch():
    probe = (
        "import sys, metrale.lookup, metrale.lookup.bench\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == ""


def test_public_names_are_exported():
    for name in (
        "PromptLookupConfig",
        "PromptLookupSeq",
        "SharedLookupConfig",
        "SharedLookup",
        "ScopeKey",
        "LookupStats",
    ):
        assert name in metrale.lookup.__all__
        assert hasattr(metrale.lookup, name)
