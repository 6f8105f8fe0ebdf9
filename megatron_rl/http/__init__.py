"""HTTP for every part of the package that serves or calls it: request bodies the servers take
(`body.py`), the servers' start-up and key check (`server.py`), and the clients' session and
retry policy (`client.py`)."""
