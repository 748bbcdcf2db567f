def pytest_configure(config):
    config.addinivalue_line("markers", "large: needs several GiB of host or GPU memory (skips with a reason otherwise)")
