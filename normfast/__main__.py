"""``python -m normfast`` (also what ``torchrun -m normfast`` runs)."""

from normfast.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
