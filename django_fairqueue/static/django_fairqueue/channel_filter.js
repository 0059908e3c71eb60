// The message list's channel filter: picking a channel in the autocomplete opens the list
// filtered by it (the other filters, the search and the sort are kept).
'use strict';
(function($) {
    $(document).on('change', '.fq-channel-filter select', function() {
        const holder = this.closest('.fq-channel-filter');
        const base = holder.dataset.base || '?';
        const value = $(this).val();
        const glue = base === '?' ? '' : '&';
        window.location.search = value
            ? base + glue + encodeURIComponent(holder.dataset.parameter) + '=' + encodeURIComponent(value)
            : base;
    });
})(django.jQuery);
