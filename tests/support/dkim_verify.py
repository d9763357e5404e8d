"""Verifies a message's DKIM-Signature with dkimpy, the way a receiving
server would, with DNS answered from the command line.

usage: dkim_verify.py NAME TXT < message
NAME is the record's name (selector._domainkey.domain), TXT its value.
Prints "pass" or "fail: <reason>"; exits 0 either way.
"""
import sys

import dkim


def main():
    name, txt = sys.argv[1], sys.argv[2]

    def dns(qname, timeout=5):
        if qname.decode().rstrip(".").lower() == name.lower():
            return txt.encode()
        return None

    message = sys.stdin.buffer.read()
    verifier = dkim.DKIM(message)
    try:
        ok = verifier.verify(dnsfunc=dns)
    except dkim.DKIMException as e:
        print(f"fail: {e}")
        return
    print("pass" if ok else "fail: signature does not verify")


main()
