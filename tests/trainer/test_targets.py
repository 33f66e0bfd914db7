"""Weight-sync targets: a service name stands for every replica behind it."""

from services.trainer.fleet import expand_targets


def test_names_resolve_to_every_address_and_literals_pass_through():
    assert expand_targets(["127.0.0.1:50051"]) == ["127.0.0.1:50051"]
    resolved = expand_targets(["localhost:7000"])
    assert resolved and all(t.endswith(":7000") and "localhost" not in t for t in resolved)


def test_unresolvable_names_are_kept_for_the_push_to_report():
    assert expand_targets(["no-such-host.invalid:5"]) == ["no-such-host.invalid:5"]
