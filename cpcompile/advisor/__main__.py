"""``python -m cpcompile.advisor``: the advisor's command line (:func:`cpcompile.advisor.advise.main`)."""

from cpcompile.advisor.advise import main

if __name__ == "__main__":
    main()
