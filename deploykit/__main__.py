"""``python -m deploykit`` is the same as the ``deploykit`` command."""

from deploykit.cli import main

if __name__ == "__main__":
    main()
