"""Issue 34's measure, run: the pipeline config followed through the export stage as a parameter
(stages/tools/config_walk.py). The job is worked out once (stages/planning/job.py) and priced once
(stages/planning/fitting.py), so the walk visits each module once, in the layers' order, and never
climbs back into one it has left."""

from __future__ import annotations

import pytest

from stages.tools.config_walk import Walk, export_walk

pytestmark = pytest.mark.slow


def test_the_config_walks_through_export_one_way():
    walk = export_walk("tiny")
    assert walk.returns == [], walk.text()
    assert len(walk.modules) <= 8, walk.text()
    modules = walk.modules
    # Worked out once, then priced: the job before the plan, and nothing derives it again after.
    assert modules.index("planning/job.py") < modules.index("planning/fitting.py"), walk.text()
    entered = {name for _, names in walk.stays for name in names}
    assert {"build", "part_layers", "make_plan"} <= entered, walk.text()
    # The plan reads the job's parts: the part split runs once, in the job's stay.
    assert [m for m, names in walk.stays if "part_layers" in names] == ["planning/job.py"], walk.text()


def test_a_return_is_counted():
    """A library module entered again is a return; the stage's own module (the first) drives the walk."""
    stays = [("s.py", ["run"]), ("b.py", ["g"]), ("s.py", ["h"]), ("c.py", ["i"]), ("b.py", ["j"])]
    walk = Walk([(m, list(n)) for m, n in stays])
    assert walk.returns == ["b.py"] and walk.modules == ["s.py", "b.py", "c.py"]
    assert walk.text().startswith("5 stays in 3 modules, 1 returns")
