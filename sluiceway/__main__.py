from sluiceway.server.cli import main

# Guarded: a spawned child process (vLLM's engine core) imports the main
# module again, as ``__mp_main__``, and must not start a second server.
if __name__ == "__main__":
    raise SystemExit(main())
