"""How a site tests a model: FedUQ's default protocol, or the official FedEvi code's, as switches (no FLARE here).

FedUQ tests at the stored mask resolution (384 x 384 for the shared polyp data) with an 8-connected largest-component
reduction and scores an empty prediction as empty. The official FedEvi code tests at the training resolution, keeps
the largest 4-connected component, turns an empty prediction into a whole-image mask (a quirk) and tests in the
rounds where the mean validation loss improved. :class:`TestProtocol` is the executor argument ``test_protocol``
that selects either, key by key; ``feduq configure --official-protocol`` sets the official one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["TestProtocol", "OFFICIAL_FEDEVI"]


@dataclass(frozen=True)
class TestProtocol:
    """The executor argument ``test_protocol`` (every key optional; the defaults are FedUQ's protocol).

    Attributes:
        resolution: ``"stored"`` (default): logits are resampled to the stored mask (HD95 in stored pixels);
            ``"training"``: the test masks are resized to the network's input size with the validation transforms
            and scored there (HD95 in pixels at ``image_size``), as the official code does.
        connectivity: neighbours of the largest-component post-processing, 8 (default) or 4 (official).
        empty_prediction: ``"empty"`` (default) or ``"whole_image"``, the official quirk (see
            :func:`feduq.scores.scoring.evaluate_test`); it raises Dice on images where nothing is predicted.
        every_round: also test the received global model at the start of every round and log its test Dice and
            HD95 in the site's ``FEDUQ_TRAIN`` line (``test_dice_global``, ``test_hd95_global``), a learning curve
            of test Dice; never sent to the server.
    """

    __test__ = False  # not a pytest test class

    resolution: str = "stored"
    connectivity: int = 8
    empty_prediction: str = "empty"
    every_round: bool = False

    @classmethod
    def from_json(cls, value: dict | None) -> "TestProtocol":
        """Build from the job's JSON object (``None``: the defaults).

        Raises:
            ValueError: not an object, an unknown key (naming the known ones), or a value out of range, each named
                as ``test_protocol.<key>``.
        """
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"executor argument test_protocol={value!r}: expected a JSON object")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"executor argument test_protocol.{unknown[0]} is unknown; known keys: {known}")
        proto = cls(**value)
        checks = (("resolution", proto.resolution in ("stored", "training"), '"stored" or "training"'),
                  ("connectivity", proto.connectivity in (4, 8) and not isinstance(proto.connectivity, bool), "4 or 8"),
                  ("empty_prediction", proto.empty_prediction in ("empty", "whole_image"), '"empty" or "whole_image"'),
                  ("every_round", isinstance(proto.every_round, bool), "true or false"))
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"executor argument test_protocol.{key}={getattr(proto, key)!r} is out of range: "
                                 f"expected {expected}")
        return proto

    def to_json(self) -> dict:
        return asdict(self)


#: The official FedEvi code's test protocol, without its empty-prediction quirk (a switch of its own).
OFFICIAL_FEDEVI = TestProtocol(resolution="training", connectivity=4, empty_prediction="empty", every_round=True)
