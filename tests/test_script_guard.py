"""Where a script starts its job: under its main guard (spawned workers) or at its top level (Lightning's launch)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from torchyard.trainer.cluster.script_guard import guard_holds

SCRIPT = textwrap.dedent('''
    import sys
    mode = sys.argv[1]
    if mode == "train":
        if __name__ == "__main__":
            fit()                           # line 6
        fit()                               # line 7: inside `if mode`, but outside the guard
    if __name__ == "__main__":
        for epoch in range(2):
            fit()                           # line 10
    else:
        fit()                               # line 12: the guard's else runs when a worker imports the script
    def main():
        fit()                               # line 14: a function's body is not the script's own code
    fit()                                   # line 15
    try:
        if __name__ == "__main__": fit()    # line 17
    finally:
        pass
''')


@pytest.mark.parametrize("line, guarded", [(6, True), (7, False), (10, True), (12, False), (14, False), (15, False),
                                           (17, True)])
def test_a_guard_is_recognised_nested_in_other_blocks_and_only_its_body_counts(line, guarded):
    assert guard_holds(ast.parse(SCRIPT), line) is guarded
