"""Suite-wide test settings.

Hypothesis' default 200 ms deadline per example and its too-slow health check
fail a property test because the machine is busy, not because the property
broke (test_kdf's HMAC property did exactly that on a loaded 2-core CI box);
speed is the benches' business (bench/), so neither applies here.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("talos", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("talos")
