"""The consumer bias, as a pure core: when it holds publishes back and how deliveries pay for them."""

from __future__ import annotations

from pipeline.broker.consumer_bias import MAX_ALLOWANCE, RATIO, ConsumerBias


def test_publishes_flow_freely_while_nothing_is_ready_or_no_consumer_is_short_of_room():
    bias = ConsumerBias()
    bias.assess(taken=5_000, delivered=0, ready=5_000, starved=False)      # no consumer, or one its client holds up
    assert bias.may_take()
    bias.assess(taken=9_000, delivered=9_000, ready=0, starved=True)       # everything handed on
    assert bias.may_take() and not bias.active and bias.engaged == 0


def test_a_starved_consumer_with_messages_ready_holds_publishes_until_deliveries_pay_for_them():
    bias = ConsumerBias()
    bias.assess(taken=1_000, delivered=600, ready=400, starved=True)
    assert bias.active and not bias.may_take() and bias.engaged == 1
    bias.assess(taken=1_000, delivered=611, ready=389, starved=True)       # 11 deliveries earn 10 publishes
    assert bias.may_take() and abs(bias.allowance - 11 / RATIO) < 1e-9
    bias.assess(taken=1_010, delivered=611, ready=399, starved=True)
    assert not bias.may_take()


def test_a_batch_read_in_one_go_is_a_debt_that_later_deliveries_pay_back():
    bias = ConsumerBias()
    bias.assess(taken=100, delivered=0, ready=100, starved=True)
    bias.assess(taken=356, delivered=11, ready=345, starved=True)          # 10 earned, 256 taken
    assert bias.allowance == -246 and not bias.may_take()
    bias.assess(taken=356, delivered=11 + round(247 * RATIO), ready=74, starved=True)
    assert bias.may_take()


def test_deliveries_bank_at_most_one_batch_ahead():
    bias = ConsumerBias()
    bias.assess(taken=10, delivered=0, ready=10, starved=True)
    bias.assess(taken=10, delivered=100_000, ready=10, starved=True)
    assert bias.allowance == MAX_ALLOWANCE


def test_the_bias_ends_with_the_backlog_and_starts_afresh_without_credit_saved_from_before():
    bias = ConsumerBias()
    bias.assess(taken=10, delivered=0, ready=10, starved=True)
    bias.assess(taken=10, delivered=100, ready=0, starved=True)            # drained: publishes flow again
    assert not bias.active and bias.may_take()
    bias.assess(taken=5_000, delivered=4_000, ready=1_000, starved=True)
    assert bias.active and not bias.may_take() and bias.engaged == 2
