"""Kits the tests share: brokers, boxes, releases, rollouts and their child processes."""
