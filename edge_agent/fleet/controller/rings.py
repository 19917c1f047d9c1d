"""Where a release's stage may go: the boxes of which fleets (`[stages]` of the
controller's settings, `config.controller.StageSettings`).

Boxes carry no labels of their own; what the controller knows of every box is its fleet
(the id it reports under, and registers with). So a fleet is a ring, named by the least
proven stage its boxes take, and the stages are ordered (`protocol.materials.STAGES`):

    ring         takes releases of stage
    experiment   experiment, internal, production
    internal     internal, production
    production   production

A fleet not listed is in `unlisted`'s ring: `experiment` by default, so a controller with
no `[stages]` rolls out as it did before stages; `production` holds a new fleet to
production releases until someone lists it.

A rollout whose selection reaches a box outside its release's rings is refused, naming
the boxes (`outside`, `refusal`), never narrowed: an operator who typed `--devices all`
for an experiment should learn that it would not reach the shops, not find out later that
it quietly did not. Pure: data in, the refusal's words out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from edge_agent.config.controller import StageSettings
from edge_agent.fleet.protocol.materials import STAGES

SHOWN = 10  # boxes a refusal names; the rest are counted


@dataclass(frozen=True)
class Rings:
    """Each fleet's ring (`StageSettings.fleets`), and the ring of the others."""

    fleets: Mapping[str, str] = field(default_factory=dict)
    unlisted: str = "experiment"

    @classmethod
    def of(cls, settings: StageSettings) -> Rings:
        return cls(dict(settings.fleets), settings.unlisted)

    def ring(self, fleet: str) -> str:
        return self.fleets.get(fleet, self.unlisted)

    def takes(self, fleet: str, stage: str) -> bool:
        """Whether the boxes of `fleet` may get a release of `stage`."""
        return STAGES.index(self.ring(fleet)) <= STAGES.index(stage)

    def outside(self, stage: str, devices: Mapping[str, str]) -> dict[str, str]:
        """The devices (device -> fleet) that a release of `stage` may not go to."""
        return {d: f for d, f in sorted(devices.items()) if not self.takes(f, stage)}

    def refusal(self, ref: str, stage: str, selector: str, devices: Mapping[str, str]
                ) -> str | None:
        """Why a rollout of `ref` (of `stage`) to `devices`, chosen by `selector`, is
        refused; None where every device takes it."""
        out = self.outside(stage, devices)
        if not out:
            return None
        rings = [r for r in STAGES if STAGES.index(r) <= STAGES.index(stage)]
        named = ", ".join(f"{d} (fleet {f}: {self.ring(f)})"
                          for d, f in list(out.items())[:SHOWN])
        more = f" and {len(out) - SHOWN} more" if len(out) > SHOWN else ""
        article = "an" if stage[0] in "aeiou" else "a"
        return (f"{ref} is {article} {stage} release: it goes only to fleets of the "
                f"{' or '.join(rings)} ring ([stages] in the controller's settings); "
                f"--devices {selector!r} reaches {len(out)} device(s) outside them: "
                f"{named}{more}")
