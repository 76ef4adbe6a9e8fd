"""The demo: demo/orders_upstream.py (the "orders" API the e2e tests and `make run` put behind
Envoy) and demo/run.py (`make run`)."""
