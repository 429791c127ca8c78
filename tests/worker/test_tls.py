"""Connection URLs: secrets never reach the log."""
from __future__ import annotations

import pytest

from worker.settings import redact_url

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("url, logged", [
    ("amqp://guest:s3cret@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
    ("amqp://T0KEN@broker/vh", "amqp://***@broker/vh"),  # a token as the user name
    ("amqps://u:p%40ss@[::1]:5671/%2f?cafile=/ca.pem", "amqps://u:***@[::1]:5671/%2f?cafile=/ca.pem"),
    ("amqp://:s3cret@broker", "amqp://:***@broker"),
    ("amqp://broker:5672/", "amqp://broker:5672/"),
])
def test_url_logged_without_password_or_token(url, logged):
    assert redact_url(url) == logged
