"""tablemail's client: write mails as rows of tablemail's queue table, in the
application's own database transaction (DESIGN §17). ``tablemail.django``
holds the Django email backend."""

__version__ = "0.1.0"
