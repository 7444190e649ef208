"""`python -m tf_adasum.run`: the launcher (tf_adasum/launch/cli.py), at the path scripts use."""

from tf_adasum.launch.cli import main

if __name__ == "__main__":
    main()
