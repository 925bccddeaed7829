"""Run as ``python -m ftrun_testmod OUT_DIR ...`` (with tests/scripts on PYTHONPATH): the worker.py rank."""

if __name__ == "__main__":
    from worker import main

    main()
