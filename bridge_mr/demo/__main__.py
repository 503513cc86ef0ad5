"""`python -m bridge_mr.demo`: federated learning on digits, bridge_mr beside pure torch."""

from . import main

if __name__ == "__main__":
    main()
