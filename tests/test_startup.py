"""What a process pays before `specula generate`'s first token: only the subcommand's own modules load, and
OpenMP threads wait passively unless the user chose otherwise. No timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = ("import os, sys; import specula.cli as cli; cli.build_parser('generate'); "
         "print(os.environ.get('OMP_WAIT_POLICY'), "
         "sorted({m.split('.')[1] for m in sys.modules if m.startswith('specula.') and m.count('.') >= 1}))")


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_generate_loads_neither_the_trainers_nor_the_benchmark_nor_the_certifier():
    policy, packages = probe().split(" ", 1)
    assert policy == "PASSIVE"
    for heavy in ("training", "bench", "certify", "serve"):
        assert f"'{heavy}'" not in packages


def test_a_wait_policy_the_user_chose_is_kept():
    assert probe(OMP_WAIT_POLICY="ACTIVE").startswith("ACTIVE ")
    assert probe(GOMP_SPINCOUNT="1000").startswith("None ")
