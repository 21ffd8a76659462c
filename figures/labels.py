"""Text labels next to scatter points that do not overlap each other, the points, or the axes edge.

A greedy placer: for each point, try positions around it (nearest first) and keep the first whose text box is
free; a label pushed further out gets a thin leader line. Deterministic, so re-rendering gives the same figure.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from matplotlib.transforms import Bbox

POINT_HALF_PX = 7.0
# (dx, dy) in points and the alignment that puts the text on that side of the point; nearest positions first.
_DIRECTIONS = (
    ((1, 0), "left", "center"), ((-1, 0), "right", "center"), ((0, 1), "center", "bottom"),
    ((0, -1), "center", "top"), ((1, 1), "left", "bottom"), ((-1, 1), "right", "bottom"),
    ((1, -1), "left", "top"), ((-1, -1), "right", "top"),
)
_DISTANCES = (6, 15, 27)


def label_points(ax: Axes, labels: Sequence[tuple[float, float, str, dict]], *, avoid_x: Sequence[float] = (),
                 avoid_y: Sequence[float] = ()) -> list:
    """Annotate each point: `labels` holds (x, y, text, text keyword arguments); earlier labels get the nearer spots.

    `avoid_x` / `avoid_y` are data positions of vertical / horizontal reference lines that labels must not cross.
    Call after everything else is drawn and the axes limits are final: placement is done in display space.
    Returns the annotation artists.
    """
    fig = ax.get_figure(root=True)
    assert fig is not None  # an Axes made by a figure belongs to it
    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.draw_without_rendering()  # settles constrained layout, so display positions are the final ones
    assert hasattr(fig.canvas, "get_renderer")  # an Agg canvas was attached above where it had none
    renderer = fig.canvas.get_renderer()
    to_display = ax.transData.transform
    occupied = [_point_box(to_display((x, y))) for x, y, _, _ in labels]
    frame = ax.get_window_extent(renderer)
    for x in avoid_x:
        px = to_display((x, 0.0))[0]
        occupied.append(Bbox.from_extents(px - 1, frame.y0, px + 1, frame.y1))
    for y in avoid_y:
        py = to_display((0.0, y))[1]
        occupied.append(Bbox.from_extents(frame.x0, py - 1, frame.x1, py + 1))
    placed = []
    for x, y, text, text_kw in labels:
        annotation = None
        for distance in _DISTANCES:
            for (dx, dy), ha, va in _DIRECTIONS:
                annotation = ax.annotate(
                    text, (x, y), xytext=(dx * distance, dy * distance), textcoords="offset points", ha=ha, va=va,
                    annotation_clip=False, in_layout=False,
                    arrowprops=None if distance == _DISTANCES[0] else {"arrowstyle": "-", "lw": 0.5,
                                                                       "color": text_kw.get("color", "black")},
                    **text_kw)
                box = _text_box(annotation, renderer)
                if _inside(box, frame) and not any(box.overlaps(o) for o in occupied):
                    break
                annotation.remove()
                annotation = None
            if annotation is not None:
                break
        if annotation is None:  # crowded beyond every candidate: nearest position, overlap accepted
            (dx, dy), ha, va = _DIRECTIONS[0]
            annotation = ax.annotate(text, (x, y), xytext=(dx * _DISTANCES[0], dy * _DISTANCES[0]),
                                     textcoords="offset points", ha=ha, va=va, in_layout=False, **text_kw)
            box = _text_box(annotation, renderer)
        occupied.append(box)
        placed.append(annotation)
    return placed


def _text_box(annotation, renderer) -> Bbox:
    """The text's own box; the annotation's box would include its leader line, which always touches the point."""
    annotation.update_positions(renderer)
    return Text.get_window_extent(annotation, renderer)


def _point_box(xy) -> Bbox:
    x, y = xy
    return Bbox.from_extents(x - POINT_HALF_PX, y - POINT_HALF_PX, x + POINT_HALF_PX, y + POINT_HALF_PX)


def _inside(box: Bbox, frame: Bbox) -> bool:
    return box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1
