"""The house picture of docs/architecture.md against the code: every room on the floor its imports put it on."""

from __future__ import annotations

import re

from test_layering import ROOT, imported_modules, module_name, package_modules, part_of

PAGE = ROOT / "docs" / "architecture.md"
OUTSIDE = {"benchmarks": ROOT / "benchmarks", "scripts": ROOT / "scripts"}  # rooms above the package


def room_imports() -> dict[str, set[str]]:
    """Room → the other rooms it imports (a room: a part of the package, or benchmarks/ or scripts/)."""
    rooms: dict[str, set[str]] = {}
    for path in package_modules():
        module = module_name(path)
        own = part_of(module)
        if own is not None:
            used = {part_of(name) for name in imported_modules(path.read_text(), module, path.name == "__init__.py")}
            rooms.setdefault(own, set()).update(used - {None, own})
    for room, folder in OUTSIDE.items():
        for path in folder.rglob("*.py"):
            module = ".".join((room, *path.relative_to(folder).with_suffix("").parts))
            names = imported_modules(path.read_text(), module, path.name == "__init__.py")
            used = {part_of(name) for name in names} | {name.split(".")[0] for name in names} & set(OUTSIDE)
            rooms.setdefault(room, set()).update(used - {None, room})
    return rooms


def floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    """One above the highest room imported; 1 for a room that imports none (the rooms must form no circle)."""
    found: dict[str, int] = {}

    def floor(room: str, path: tuple[str, ...] = ()) -> int:
        assert room not in path, f"circle: {' -> '.join((*path, room))}"
        if room not in found:
            found[room] = 1 + max((floor(other, (*path, room)) for other in rooms.get(room, ())), default=0)
        return found[room]

    for room in rooms:
        floor(room)
    return found


def pictured_floors(page: str) -> dict[str, int]:
    """Room → floor as the page's house block draws it (``floor N   room room/ …   what they hold``)."""
    block = page.split("<!-- house -->")[1].split("<!-- /house -->")[0]
    pictured = {}
    for number, rest in re.findall(r"^floor (\d+)\s+(.*)$", block, flags=re.M):
        names = re.split(r"\s{3,}", rest.strip())[0].split()
        pictured.update({name.rstrip("/"): int(number) for name in names})
    return pictured


def test_the_architecture_page_draws_every_room_on_its_floor():
    assert pictured_floors(PAGE.read_text()) == floors(room_imports())


def test_the_picture_check_sees_a_room_drawn_on_the_wrong_floor():
    page = PAGE.read_text().replace("floor 4   training/", "floor 3   training/")
    assert pictured_floors(page)["training"] == 3 != floors(room_imports())["training"]


def test_a_circle_of_rooms_has_no_floor():
    try:
        floors({"a": {"b"}, "b": {"a"}})
    except AssertionError as error:
        assert "circle: a -> b -> a" in str(error)
    else:
        raise AssertionError("a circle was given floors")


def test_the_house_has_seven_floors_or_fewer():
    assert max(floors(room_imports()).values()) <= 7
