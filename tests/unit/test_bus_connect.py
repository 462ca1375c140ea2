"""`moerl.bus.connect` without a server URL: one clear error, before any client is made."""

import pytest

from moerl.bus.client import BusError, connect


@pytest.mark.parametrize("url", [None, ""])
def test_connect_without_a_url_says_valkey_url_is_unset(url):
    with pytest.raises(BusError, match=r"valkey\.url is unset"):
        connect(url)
