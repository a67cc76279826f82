"""Prometheus rendering of node metrics (talos/metrics.py)."""

from __future__ import annotations

from talos.metrics import Histogram, Metrics


def test_render_counters_gauges_histogram() -> None:
    m = Metrics()
    m.inc("messages_in")
    m.inc("messages_in", 2)
    m.gauge("outbox_depth", lambda: 5)
    m.ack_latency.observe(0.0007)
    m.ack_latency.observe(3.0)
    text = m.render()
    assert "talos_messages_in 3\n" in text
    assert "talos_outbox_depth 5\n" in text
    assert 'talos_message_ack_seconds_bucket{le="0.001"} 1\n' in text
    assert 'talos_message_ack_seconds_bucket{le="5.0"} 2\n' in text
    assert 'talos_message_ack_seconds_bucket{le="+Inf"} 2\n' in text
    assert "talos_message_ack_seconds_count 2\n" in text


def test_histogram_overflow_bucket() -> None:
    h = Histogram((1.0,))
    h.observe(2.0)
    assert h.counts == [0, 1]
    assert h.total == 2.0
