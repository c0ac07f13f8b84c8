"""What chapter 13 (the 3-D capstone) draws, `gpucourse/chapters/ch13.py`: the mesh where each rank said it sat."""
import pytest
from matplotlib import patches

from gpucourse.chapters import ch13


def layout(pp, dp, tp):
    """init_device_mesh's (pp, dp, tp) layout, tp innermost: rank -> (pp, dp, tp)."""
    return {(p * dp + d) * tp + t: (p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)}


def test_the_mesh_figure_draws_every_rank_its_groups_and_the_stages_links():
    fig = ch13.mesh_figure(layout(2, 2, 2), "cpu · gloo · 8 ranks")
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts if t.get_text().startswith("rank")) == sorted(
        f"rank {r}" for r in range(8))
    outlines = [p for p in ax.patches if isinstance(p, patches.Rectangle) and not p.get_fill()]
    assert len([p for p in outlines if p.get_linestyle() == "solid"]) == 2 * 2  # a tp group per (stage, dp row)
    assert len([p for p in outlines if p.get_linestyle() == "--"]) == 2 * 2  # a dp group per (stage, tp column)
    assert len([c for c in ax.get_children() if type(c).__name__ == "Annotation"]) == 1  # one arrow between the two stages
    assert "cpu · gloo · 8 ranks" in ax.get_title()


def test_ranks_that_do_not_fill_the_mesh_once_are_refused():
    coords = layout(2, 2, 2)
    coords[7] = coords[6]  # two ranks say they sit at the same place
    with pytest.raises(ValueError, match="do not fill"):
        ch13.mesh_figure(coords)
    with pytest.raises(ValueError, match="needs"):
        ch13.mesh_figure({})
