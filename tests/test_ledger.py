"""The pure memory ledger: calibrate, reserve, release, available, deficit."""

from __future__ import annotations

from actors.ledger import Breakdown, DeviceUse, Ledger

GiB = 1024**3


def need(gib: float, device: str = "gpu0", total: int = 10 * GiB, free: int = 10 * GiB,
         kind: str = "device") -> Breakdown:
    size = int(gib * GiB)
    return Breakdown(n_ctx=4096, devices=[DeviceUse(kind=kind, name=device, total=total,
                                                    free=free, model=size // 2,
                                                    context=size // 4,
                                                    compute=size - size // 2 - size // 4)])


def test_two_4gib_models_fit_on_10gib_with_1gib_margin_and_a_third_does_not() -> None:
    ledger = Ledger(margin=1 * GiB)
    ledger.calibrate(need(4), reporter=None)  # a measure report: nothing allocated
    assert ledger.available("gpu0") == 10 * GiB
    assert ledger.deficit(need(4)) == {}
    ledger.reserve("a", need(4))
    assert ledger.deficit(need(4)) == {}
    ledger.reserve("b", need(4))
    assert ledger.available("gpu0") == 2 * GiB
    assert ledger.deficit(need(4)) == {"gpu0": 3 * GiB}  # 4 needed, 2 - 1 margin left
    ledger.release("a")
    assert ledger.deficit(need(4)) == {}


def test_calibration_counts_outside_usage_as_external() -> None:
    ledger = Ledger(margin=0)
    ledger.reserve("a", need(4))
    # a report from a: 10 total, 3 free, a itself uses 4 -> 3 used by someone else
    ledger.calibrate(need(4, free=3 * GiB), reporter="a")
    assert ledger.devices["gpu0"].external == 3 * GiB
    assert ledger.available("gpu0") == 3 * GiB
    assert ledger.deficit(need(4)) == {"gpu0": 1 * GiB}
    # the outside process went away
    ledger.calibrate(need(4, free=6 * GiB), reporter="a")
    assert ledger.devices["gpu0"].external == 0 and ledger.deficit(need(4)) == {}


def test_what_other_models_hold_is_not_external() -> None:
    ledger = Ledger(margin=0)
    ledger.reserve("a", need(4))
    ledger.reserve("b", need(2))
    ledger.calibrate(need(2, free=4 * GiB), reporter="b")  # 10 - 4 (a) - 2 (b) = 4 free
    assert ledger.devices["gpu0"].external == 0


def test_unreported_devices_and_host_memory_are_unlimited_by_default() -> None:
    ledger = Ledger(margin=0)
    assert ledger.available("gpu9") is None
    assert ledger.deficit(need(100, device="gpu9")) == {}
    host = need(64, device="host", total=32 * GiB, free=32 * GiB, kind="host")
    ledger.calibrate(host, reporter=None)
    assert ledger.deficit(host) == {}
    strict = Ledger(margin=0, account_host=True)
    strict.calibrate(host, reporter=None)
    assert strict.deficit(host) == {"host": 32 * GiB}


def test_a_reservation_is_replaced_and_release_of_unknown_is_harmless() -> None:
    ledger = Ledger(margin=0)
    ledger.calibrate(need(1), reporter=None)
    ledger.reserve("a", need(8))  # loading: its max
    ledger.reserve("a", need(4))  # ready: what it really uses
    assert ledger.available("gpu0") == 6 * GiB
    ledger.release("zzz")
    ledger.reserve("b", None)
    assert ledger.held.keys() == {"a"}


def test_a_model_holds_the_larger_of_its_reservation_and_its_seen_use() -> None:
    ledger = Ledger(margin=0)
    ledger.calibrate(need(1), reporter=None)
    ledger.reserve("a", need(4))
    ledger.saw("a", {"gpu0": 3 * GiB})
    assert ledger.held["a"] == {"gpu0": 4 * GiB}
    ledger.saw("a", {"gpu0": 6 * GiB})  # it grew past its reservation
    assert ledger.held["a"] == {"gpu0": 6 * GiB} and ledger.available("gpu0") == 4 * GiB
    ledger.unreserve("a")  # it sleeps: what the device still shows stays held
    ledger.saw("a", {"gpu0": GiB // 2})
    assert ledger.held["a"] == {"gpu0": GiB // 2}
    ledger.release("a")  # reaped and no longer reported
    assert "a" not in ledger.held and ledger.available("gpu0") == 10 * GiB


def test_observe_counts_only_what_corral_children_do_not_use_as_external() -> None:
    from actors.ledger import DeviceSample

    ledger = Ledger(margin=0)
    ledger.reserve("a", need(4))
    sample = DeviceSample("gpu0", "device", 10 * GiB, 3 * GiB, "simulated")
    ledger.observe(sample, managed=2 * GiB)  # a has allocated 2 of its 4 so far
    assert ledger.devices["gpu0"].external == 5 * GiB
    assert ledger.available("gpu0") == 1 * GiB  # 10 - 5 external - 4 reserved
    ledger.observe(sample, managed=None)  # no per-process figures: trust the holds
    assert ledger.devices["gpu0"].external == 3 * GiB


def test_deficit_counts_memory_that_is_on_its_way_back() -> None:
    ledger = Ledger(margin=1 * GiB)
    ledger.calibrate(need(1), reporter=None)
    ledger.reserve("a", need(4))
    ledger.reserve("b", need(4))
    assert ledger.deficit(need(4)) == {"gpu0": 3 * GiB}
    assert ledger.deficit(need(4), give_back=ledger.holds_of(["a"])) == {}
