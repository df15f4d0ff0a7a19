"""What mending (or resizing) a pool did, in words: ``Mended``, and ``Mended.say``, the text the cell's output and
``%ddp status`` say, with the names each rank lacks and the cells that bound them, to run again."""
from __future__ import annotations

import dataclasses

from ... import units


@dataclasses.dataclass
class Mended:
    how: str  # "healed" | "shrunk"
    lost: list  # the Loss records mended
    seconds: float
    copied: list = dataclasses.field(default_factory=list)
    peer: int | None = None
    lacking: dict = dataclasses.field(default_factory=dict)  # name -> why
    unmade: dict = dataclasses.field(default_factory=dict)  # name -> why: still on the old group, not made anew
    rebuilt: list = dataclasses.field(default_factory=list)
    renumbered: dict = dataclasses.field(default_factory=dict)  # shrink: old rank -> new
    sizes: tuple = (0, 0)  # resize: the world size before and after
    instead: str = ""  # shrunk where --on-loss heal was asked: why it could not heal

    @property
    def joined(self) -> bool:
        """New ranks joined the pool (a replacement, or a pool grown)."""
        return self.how == "healed" or self.how == "resized" and self.sizes[1] > self.sizes[0]

    def say(self, bound_by: dict) -> str:
        """What the cell's output and %ddp status say, with the names to run again and the cells that bound them."""
        ranks = ", ".join(str(loss.rank) for loss in self.lost)
        if self.how == "resized":
            old, new = self.sizes
            took = (f"; rank(s) {units.rank_span(range(old, new))} took {len(self.copied)} name(s) from rank 0"
                    if new > old and self.copied else "")
            lines = [f"resized the pool from {old} to {new} ranks in {self.seconds:.1f} s{took}."]
            ranks = units.rank_span(range(old, new)) if new > old else ""
        elif self.how == "shrunk":
            moves = ", ".join(f"{a}→{b}" for a, b in sorted(self.renumbered.items()) if a != b) or "none"
            lines = [f"shrank the pool in {self.seconds:.1f} s: rank(s) {ranks} gone, the survivors renumbered "
                     f"({moves}) in a new process group of {len(self.renumbered)}."]
            if self.instead:
                lines.insert(0, f"could not heal the pool: {self.instead}; it shrank instead (%ddp resize "
                                f"{len(self.renumbered) + len(self.lost)} grows it back once there is room).")
        else:
            what = f"{len(self.copied)} name(s) from rank {self.peer}" if self.copied else "no names from a peer"
            lines = [f"healed the pool in {self.seconds:.1f} s: a new rank {ranks} took {what} "
                     f"({', '.join(self.copied[:12])}{', ...' if len(self.copied) > 12 else ''})"
                     if self.copied else f"healed the pool in {self.seconds:.1f} s: a new rank {ranks}, {what}."]
        if self.rebuilt:
            lines.append("made anew on the new process group: " + ", ".join(f"{name} ({kind})"
                                                                            for name, kind in self.rebuilt))
        if self.how != "healed":
            lines.append("what a cell made from world_size (a per-rank batch, a scaled learning rate) is as it was on "
                         "every rank: make it again where it matters")
        if self.lacking and self.how == "shrunk" or self.lacking and self.how == "resized" and not ranks:
            lines.append("these names were made from each rank's old number or the old group; run the cells that bound "
                         "them again:")
        elif self.lacking:
            lines.append(f"rank(s) {ranks} lack these names; run the cells that bound them again:")
        if self.lacking:
            lines += _named(self.lacking, bound_by)
        if self.unmade:
            lines.append("these names still use the old process group (they could not be made anew on the new one); "
                         "run the cells that bound them again:")
            lines += _named(self.unmade, bound_by)
        return "\n".join(lines)


def _named(names: dict, bound_by: dict) -> list:
    return [f"  {name} ({bound_by.get(name, 'a cell of the pool')}): {why}" for name, why in sorted(names.items())]
