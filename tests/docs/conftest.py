"""Docs tests. The xdist_group marker is registered here too, so that these
tests run without pytest-xdist installed and without an unknown-mark warning."""


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): run the marked tests on one pytest-xdist worker")
