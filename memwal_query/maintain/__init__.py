"""maintain"""
