"""Verifies a message's DKIM-Signature with dkimpy, the way a receiving
server would, with DNS answered from the command line.

usage: dkim_verify.py NAME TXT [NAME TXT ...] < message
Each NAME is a record's name (selector._domainkey.domain), TXT its value: the
keys published, as a receiver finds them; the signature names which one it
needs. Prints "pass" or "fail: <reason>"; exits 0 either way.
"""
import sys

import dkim


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2:
        sys.exit(__doc__)
    records = {name.lower(): txt for name, txt in zip(args[::2], args[1::2])}

    def dns(qname, timeout=5):
        txt = records.get(qname.decode().rstrip(".").lower())
        return txt.encode() if txt is not None else None

    message = sys.stdin.buffer.read()
    verifier = dkim.DKIM(message)
    try:
        ok = verifier.verify(dnsfunc=dns)
    except dkim.DKIMException as e:
        print(f"fail: {e}")
        return
    print("pass" if ok else "fail: signature does not verify")


main()
