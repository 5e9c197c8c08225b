"""The suite's expensive modules (serving, expert parallelism) are marked xdist_group so that `--dist loadgroup` sends
each to one worker and builds its module fixtures once. pytest-xdist does that by adding the group to the node id;
pytest 9.2 broke it silently (pyproject.toml pins pytest below it), so this checks that it still happens."""

import pytest

pytestmark = [pytest.mark.xdist_group("xdist_groups"), pytest.mark.quick]


def test_loadgroup_puts_the_group_in_the_node_id(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run under pytest-xdist's --dist loadgroup (the README's test command is)")
    assert request.node.nodeid.endswith("@xdist_groups"), (
        f"--dist loadgroup did not group {request.node.nodeid}: marked modules run on every worker and build their "
        f"fixtures once each; install the pytest and pytest-xdist versions pyproject.toml allows")
