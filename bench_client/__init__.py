"""The benchmark client behind ``shmgate bench``: a load generator and the minimal HTTP client it drives.

Its own package because it is a client of the gateway, not a part of it: it runs in another process
(often on another machine) and speaks only HTTP to the server it measures.
"""
